// Optimizer steps over the flat parameter, gradient and state buffers, with PyTorch's update
// rules in the float order of crates/tandem-engine/src/optim.rs (PyTorch's single-tensor,
// foreach=False, implementation). Each element is independent and NVRTC compiles with
// --fmad=false and IEEE division and square root, so the results are bit-identical to the CPU.
//
// Scalars that PyTorch computes in Python floats (Adam's bias corrections, step size, decay
// factor) are computed on the host in double exactly as optim.rs does, and passed as floats.
// Every per-step scalar is read from device memory (the executor's step-scalar buffer, one
// host-to-device copy before each step), not passed by value, so that a step captured as a
// CUDA graph replays with the next step's learning rate and bias corrections. The layouts of
// SgdScalars and AdamScalars are mirrored by crates/tandem-cuda/src/executor/scalars.rs.
//
// Launch: one thread per parameter.

// SGD's settings at one step (24 bytes).
struct SgdScalars {
    float lr, momentum, dampening, weight_decay;
    int nesterov, first_step;
};

// torch.optim.SGD: weight decay (L2, added to the gradient), momentum with dampening (the
// buffer starts as the first gradient), Nesterov. momentum_buffer is unused (may be null)
// when momentum == 0.
extern "C" __global__ void sgd_step(float* params, const float* grads, float* momentum_buffer,
                                    long long n, const SgdScalars* scalars) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float lr = scalars->lr, momentum = scalars->momentum;
    const float dampening = scalars->dampening, weight_decay = scalars->weight_decay;
    const int nesterov = scalars->nesterov, first_step = scalars->first_step;
    float p = params[i];
    float g = grads[i];
    if (weight_decay != 0.0f) g = g + weight_decay * p;
    if (momentum != 0.0f) {
        float buffer = first_step ? g : momentum_buffer[i] * momentum + (1.0f - dampening) * g;
        momentum_buffer[i] = buffer;
        g = nesterov ? g + momentum * buffer : buffer;
    }
    params[i] = p + -lr * g;
}

// torch.lerp(start, end, weight) as ATen computes it.
__device__ float lerp(float start, float end, float weight) {
    return fabsf(weight) < 0.5f ? start + weight * (end - start)
                                : end - (end - start) * (1.0f - weight);
}

// torch.optim.Adam (decoupled == 0: L2 weight decay added to the gradient) and AdamW
// (decoupled == 1: params *= decay_factor first), no amsgrad. Host-computed scalars:
//   step_size = lr / (1 - beta1^t), bias_correction2_sqrt = sqrt(1 - beta2^t),
//   decay_factor = 1 - lr * weight_decay, lerp_weight = 1 - beta1, sq_weight = 1 - beta2
// (36 bytes).
struct AdamScalars {
    float step_size, beta2, bias_correction2_sqrt, eps, weight_decay, decay_factor,
        lerp_weight, sq_weight;
    int decoupled;
};

extern "C" __global__ void adam_step(float* params, const float* grads, float* exp_avg,
                                     float* exp_avg_sq, long long n, const AdamScalars* scalars) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float step_size = scalars->step_size, beta2 = scalars->beta2;
    const float bias_correction2_sqrt = scalars->bias_correction2_sqrt, eps = scalars->eps;
    const float weight_decay = scalars->weight_decay, decay_factor = scalars->decay_factor;
    const float lerp_weight = scalars->lerp_weight, sq_weight = scalars->sq_weight;
    const int decoupled = scalars->decoupled;
    float p = params[i];
    float g = grads[i];
    if (weight_decay != 0.0f) {
        if (decoupled) {
            p = p * decay_factor;
        } else {
            g = g + weight_decay * p;
        }
    }
    float m = lerp(exp_avg[i], g, lerp_weight);
    float v = exp_avg_sq[i] * beta2 + sq_weight * g * g;
    float denom = sqrtf(v) / bias_correction2_sqrt + eps;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    params[i] = p + -step_size * (m / denom);
}
