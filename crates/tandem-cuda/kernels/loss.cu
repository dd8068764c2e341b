// Mean softmax cross-entropy with label smoothing over [batch, classes] logits, as PyTorch's
// CrossEntropyLoss(label_smoothing) and crates/tandem-engine/src/head.rs:
//
//   loss = mean over samples of  -(1 - eps) * log p[label] - eps * mean over classes of log p
//   grad = scale * (softmax - target) / batch,  target = (1 - eps) * onehot + eps / classes
//
// Deterministic: one thread per sample sums its row in class order (in double, as the CPU),
// and cross_entropy_mean adds the per-sample losses in sample order on one thread. The CPU's
// exp and ln are glibc's and CUDA's are its own (both within 1 ulp in double), so the loss and
// probabilities may differ from the CPU's in the last bit of the double before rounding to
// float; the gradient then follows the CPU's float operations exactly.
//
// Launch: cross_entropy_rows with one thread per sample; cross_entropy_mean with one thread;
// cross_entropy_backward with one thread per logit.

// Per sample: probabilities (softmax, float) and the sample's loss (double). A label outside
// 0..classes records the first such sample in *bad_sample (an integer atomicMin, so the
// result does not depend on scheduling); the host turns it into the CPU's InvalidLabel error.
extern "C" __global__ void cross_entropy_rows(const float* logits, const unsigned int* labels,
                                              int batch, int classes, float label_smoothing,
                                              float* probabilities, double* sample_loss,
                                              int* bad_sample) {
    int sample = blockIdx.x * blockDim.x + threadIdx.x;
    if (sample >= batch) return;
    const float* row = logits + (long long)sample * classes;
    float* probs = probabilities + (long long)sample * classes;
    unsigned int target = labels[sample];
    if (target >= (unsigned int)classes) {
        atomicMin(bad_sample, sample);
        sample_loss[sample] = 0.0;
        return;
    }
    float max = __int_as_float(0xff800000);  // -infinity
    for (int k = 0; k < classes; k++) max = fmaxf(max, row[k]);
    double sum_exp = 0.0;
    for (int k = 0; k < classes; k++) sum_exp += exp((double)row[k] - (double)max);
    double log_sum_exp = (double)max + log(sum_exp);
    double sum_log_prob = 0.0;
    for (int k = 0; k < classes; k++) {
        double log_prob = (double)row[k] - log_sum_exp;
        probs[k] = (float)exp(log_prob);
        sum_log_prob += log_prob;
    }
    double smoothing = (double)label_smoothing;
    double target_log_prob = (double)row[target] - log_sum_exp;
    double mean_log_prob = sum_log_prob / (double)classes;
    sample_loss[sample] = -(1.0 - smoothing) * target_log_prob - smoothing * mean_log_prob;
}

// The mean loss: per-sample losses added in sample order.
extern "C" __global__ void cross_entropy_mean(const double* sample_loss, int batch, float* loss) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = 0.0;
    for (int sample = 0; sample < batch; sample++) total += sample_loss[sample];
    *loss = (float)(total / (double)(batch > 1 ? batch : 1));
}

// grad_logits = (p - target) * (scale / batch), in the CPU's float operations.
extern "C" __global__ void cross_entropy_backward(const float* probabilities,
                                                  const unsigned int* labels, int batch,
                                                  int classes, float label_smoothing, float scale,
                                                  float* grad_logits) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)batch * classes) return;
    int sample = (int)(i / classes), k = (int)(i % classes);
    float factor = scale / (float)(batch > 1 ? batch : 1);
    float off_target = label_smoothing / (float)classes;
    float target = (unsigned int)k == labels[sample] ? 1.0f - label_smoothing + off_target
                                                     : off_target;
    grad_logits[i] = (probabilities[i] - target) * factor;
}
