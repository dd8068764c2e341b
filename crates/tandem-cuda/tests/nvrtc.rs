//! Every kernel file compiles with NVRTC for the H200 (sm_90); a broken source returns NVRTC's
//! log; compiled PTX is cached. Needs libnvrtc, not a GPU: skipped with a printed reason when
//! the probe does not find it, unless TANDEM_REQUIRE_NVRTC=1.

mod common;

use std::time::Instant;

use tandem_cuda::{CompileError, Compiler, GpuArch, KernelSource, Probe, PtxCache, KERNELS};

/// Kernel files whose float results are claimed bit-identical to the CPU engine's.
const BIT_IDENTICAL_TO_THE_CPU: [&str; 6] = [
    "epilogue",
    "pooling",
    "optimizers",
    "augment",
    "batchnorm",
    "convert",
];

/// The names of the `extern "C" __global__` functions of a kernel file.
fn entry_points(source: &str) -> Vec<&str> {
    source
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .collect()
}

/// The number of parameters in the C declaration of kernel `entry`.
fn c_parameter_count(source: &str, entry: &str) -> usize {
    let declaration = format!("extern \"C\" __global__ void {entry}(");
    let start = source.find(&declaration).unwrap() + declaration.len();
    let end = start + source[start..].find('{').unwrap();
    let list = source[start..end].trim().trim_end_matches(')');
    // A list given by a macro (`BN_STATS_PARAMS(float)`, shared by a kernel's float32 and
    // bfloat16 entry points) is counted in the macro's definition.
    let list = match list.split_once('(') {
        Some((name, _)) if is_identifier(name) => macro_body(source, name),
        _ => list.to_string(),
    };
    list.split(',')
        .filter(|param| !param.trim().is_empty())
        .count()
}

fn is_identifier(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The text of `#define name(...)`, its continuation lines joined.
fn macro_body(source: &str, name: &str) -> String {
    let define = format!("#define {name}(");
    let start = source
        .find(&define)
        .unwrap_or_else(|| panic!("no {define}"));
    let after_parameters = start + source[start..].find(')').unwrap() + 1;
    let mut body = String::new();
    for line in source[after_parameters..].lines() {
        let continued = line.trim_end().ends_with('\\');
        body.push_str(line.trim_end().trim_end_matches('\\'));
        if !continued {
            break;
        }
    }
    body
}

#[test]
fn every_kernel_file_compiles_for_sm_90() {
    let Some(probe) = common::probe_with_nvrtc("every_kernel_file_compiles_for_sm_90") else {
        return;
    };
    let compiler = Compiler::new(probe, GpuArch::SM_90, None).unwrap();
    let started = Instant::now();
    for kernel in KERNELS {
        let (compiled, cache_error) = compiler
            .compile(kernel)
            .unwrap_or_else(|error| panic!("{error}"));
        assert!(cache_error.is_none());
        assert!(!compiled.from_cache);
        assert!(
            compiled.warnings.trim().is_empty(),
            "{}: NVRTC warns:\n{}",
            kernel.name,
            compiled.warnings
        );
        assert!(
            compiled.ptx.contains(".target sm_90"),
            "{}: PTX for another target",
            kernel.name
        );
        // What the executor loads: an ELF object of machine code for sm_90.
        assert!(
            compiled.cubin.starts_with(b"\x7fELF"),
            "{}: the CUBIN is not an ELF object",
            kernel.name
        );
        if BIT_IDENTICAL_TO_THE_CPU.contains(&kernel.name) {
            // The premise of their bit-identity: no float multiply-add was contracted.
            assert!(
                !compiled.ptx.contains("fma.rn.f32"),
                "{}: contracted multiply-add in the PTX",
                kernel.name
            );
        }
        let entries = entry_points(kernel.source);
        assert!(!entries.is_empty(), "{}: no kernels", kernel.name);
        for &entry in &entries {
            let params = tandem_cuda::ptx_params::entry_params(&compiled.ptx, entry)
                .unwrap_or_else(|| panic!("{}: no PTX entry for {entry}", kernel.name));
            // What a launch is checked against: one known kind per C parameter.
            assert_eq!(
                params.len(),
                c_parameter_count(kernel.source, entry),
                "{}: {entry}'s PTX parameters",
                kernel.name
            );
            assert!(
                !params.contains(&tandem_cuda::ptx_params::ParamKind::Other),
                "{}: {entry} has a parameter a launch cannot fill: {params:?}",
                kernel.name
            );
            // A bfloat16 entry point is launched with its float32 twin's arguments, the
            // activations' addresses aside.
            let twin = entry
                .strip_suffix("_bf16")
                .filter(|twin| entries.contains(twin));
            if let Some(twin) = twin {
                let twin_params = tandem_cuda::ptx_params::entry_params(&compiled.ptx, twin)
                    .unwrap_or_else(|| panic!("{}: {entry} without {twin}", kernel.name));
                assert_eq!(
                    params, twin_params,
                    "{}: {entry} against {twin}",
                    kernel.name
                );
            }
        }
        eprintln!(
            "{}: {} bytes of PTX in {:.2} s",
            kernel.name,
            compiled.ptx.len(),
            compiled.compile_time.as_secs_f64()
        );
    }
    eprintln!(
        "all {} kernel files compiled for sm_90 in {:.2} s",
        KERNELS.len(),
        started.elapsed().as_secs_f64()
    );
}

/// Every kernel's typed signature (`executor::kernels`) declares the parameters of its PTX
/// entry points, its own and its bfloat16 twin's, and every entry point of every kernel file
/// has a signature: what makes a typed launch fill its kernel's parameters one for one.
#[test]
fn every_kernel_signature_matches_its_ptx() {
    let Some(probe) = common::probe_with_nvrtc("every_kernel_signature_matches_its_ptx") else {
        return;
    };
    use tandem_cuda::executor::kernels::FILES;
    let compiler = Compiler::new(probe, GpuArch::SM_90, None).unwrap();
    assert_eq!(FILES.len(), KERNELS.len());
    for (file, kernel) in FILES.iter().zip(KERNELS) {
        assert_eq!(file.name, kernel.name);
        let (compiled, _) = compiler
            .compile(kernel)
            .unwrap_or_else(|error| panic!("{error}"));
        for signature in file.signatures {
            signature
                .check_ptx(&compiled.ptx)
                .unwrap_or_else(|error| panic!("{}: {error}", kernel.name));
        }
        let mut declared: Vec<&str> = file
            .signatures
            .iter()
            .flat_map(|signature| signature.entries())
            .collect();
        let mut entries = entry_points(kernel.source);
        declared.sort_unstable();
        entries.sort_unstable();
        assert_eq!(declared, entries, "{}: entry points", kernel.name);
    }
}

#[test]
fn a_broken_kernel_returns_nvrtcs_log() {
    let Some(probe) = common::probe_with_nvrtc("a_broken_kernel_returns_nvrtcs_log") else {
        return;
    };
    let broken = KernelSource {
        name: "broken",
        source: "extern \"C\" __global__ void broken(float* x) {\n    x[0] = not_declared;\n}\n",
    };
    let compiler = Compiler::new(probe, GpuArch::SM_90, None).unwrap();
    let error = compiler.compile(&broken).unwrap_err();
    let CompileError::Compilation { kernel, log, .. } = &error else {
        panic!("expected a compilation error, got {error}");
    };
    assert_eq!(kernel, "broken");
    assert!(
        log.contains("broken.cu(2)") && log.contains("\"not_declared\" is undefined"),
        "NVRTC's log names neither the line nor the identifier:\n{log}"
    );
    let message = error.to_string();
    assert!(
        message.contains("kernel broken does not compile for sm_90"),
        "{message}"
    );
    assert!(message.contains(log.as_str()), "{message}");
}

#[test]
fn compiled_ptx_is_stored_in_the_cache_and_read_back() {
    let Some(probe) = common::probe_with_nvrtc("compiled_ptx_is_stored_in_the_cache_and_read_back")
    else {
        return;
    };
    let folder = tempfile::tempdir().unwrap();
    let cache = PtxCache::new(folder.path().join("ptx"));
    let compiler = Compiler::new(probe, GpuArch::SM_90, Some(cache.clone())).unwrap();
    let pooling = tandem_cuda::kernels::kernel("pooling").unwrap();
    let (first, error) = compiler.compile(pooling).unwrap();
    assert!(error.is_none() && !first.from_cache);
    let files: Vec<_> = std::fs::read_dir(&cache.dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(files.iter().all(|file| file.starts_with("pooling-sm_90-")
        && (file.ends_with(".ptx") || file.ends_with(".cubin"))));
    let (second, error) = compiler.compile(pooling).unwrap();
    assert!(error.is_none() && second.from_cache);
    assert_eq!(second.ptx, first.ptx);
    assert_eq!(second.cubin, first.cubin);
}

/// The sm_90 PTX of kernel file `name`.
fn sm_90_ptx(probe: &Probe, name: &str) -> String {
    let compiler = Compiler::new(probe, GpuArch::SM_90, None).unwrap();
    let kernel = tandem_cuda::kernels::kernel(name).unwrap_or_else(|| panic!("{name}.cu"));
    let (compiled, _) = compiler
        .compile(kernel)
        .unwrap_or_else(|error| panic!("{error}"));
    compiled.ptx
}

/// The data-parallel average's last step divides exactly (IEEE round-to-nearest, as the
/// host ring's `sum / world`), not with an approximate or multiply-by-reciprocal division.
#[test]
fn the_gradient_average_divides_exactly() {
    let Some(probe) = common::probe_with_nvrtc("the_gradient_average_divides_exactly") else {
        return;
    };
    let ptx = sm_90_ptx(probe, "collective");
    assert!(ptx.contains("div.rn.f32"), "{ptx}");
    for inexact in ["div.approx", "div.full", "rcp."] {
        assert!(!ptx.contains(inexact), "{inexact} in {ptx}");
    }
}

/// The exact sum's conversions are Rust's: a double to a long long truncates toward zero
/// (`cvt.rzi`, which saturates and takes NaN to 0 on the GPU, as `as` does), and the sum goes
/// to a double and then to a float each rounded to nearest; nothing is fused, approximate or
/// flushed to zero.
#[test]
fn the_exact_sum_converts_as_the_host_does() {
    let Some(probe) = common::probe_with_nvrtc("the_exact_sum_converts_as_the_host_does") else {
        return;
    };
    let ptx = sm_90_ptx(probe, "exact_sum");
    for conversion in [
        "cvt.rzi.s64.f64",
        "cvt.rn.f64.s64",
        "cvt.rn.f32.f64",
        "cvt.f64.f32",
    ] {
        assert!(ptx.contains(conversion), "{conversion} in {ptx}");
    }
    for inexact in ["fma.", "approx", ".ftz"] {
        assert!(!ptx.contains(inexact), "{inexact} in {ptx}");
    }
}

/// The bf16 conversions round on the bits with integer arithmetic, so that the host reference
/// (`tandem_cuda::bf16`) is theirs bit for bit: no hardware bfloat16 conversion, and one float
/// operation in all, the widening add.
#[test]
fn the_bf16_conversions_round_with_integer_arithmetic() {
    let Some(probe) =
        common::probe_with_nvrtc("the_bf16_conversions_round_with_integer_arithmetic")
    else {
        return;
    };
    let ptx = &sm_90_ptx(probe, "convert");
    for entry in ["float_to_bf16", "bf16_to_float", "bf16_add_to_float"] {
        assert!(
            ptx.contains(&format!(".entry {entry}(")),
            "{entry} in {ptx}"
        );
    }
    assert!(!ptx.contains("cvt.rn.bf16"), "{ptx}");
    let float_ops: Vec<&str> = ptx
        .lines()
        .map(str::trim)
        .filter(|line| {
            line.contains(".f32") && !line.starts_with("ld.") && !line.starts_with("st.")
        })
        .filter(|line| !line.starts_with("mov.") && !line.starts_with(".reg"))
        .collect();
    assert_eq!(float_ops.len(), 1, "{float_ops:?}");
    assert!(float_ops[0].starts_with("add.rn.f32"), "{float_ops:?}");
}

/// The optimizers and the augmentation's draws read every per-step scalar (learning rate,
/// bias corrections, first-step flag, epoch) through a pointer into the step-scalar buffer,
/// so that a captured step replays with the next step's values; their PTX takes no float or
/// int by value but the sizes, and holds no contracted multiply-add (bit-identity to the CPU).
#[test]
fn per_step_scalars_are_read_through_a_pointer() {
    let Some(probe) = common::probe_with_nvrtc("per_step_scalars_are_read_through_a_pointer")
    else {
        return;
    };
    let compiler = Compiler::new(probe, GpuArch::SM_90, None).unwrap();
    let compile = |name: &str| {
        let kernel = tandem_cuda::kernels::kernel(name).expect("kernel file");
        let (compiled, _) = compiler
            .compile(kernel)
            .unwrap_or_else(|error| panic!("{error}"));
        assert!(
            !compiled.ptx.contains("fma.rn.f32"),
            "{name}: contracted FMA"
        );
        compiled.ptx
    };
    use tandem_cuda::ptx_params::{entry_params, ParamKind::*};
    let params = |ptx: &str, entry: &str| entry_params(ptx, entry).expect("the PTX entry");
    let optimizers = compile("optimizers");
    // params, grads, momentum_buffer, n, scalars.
    assert_eq!(params(&optimizers, "sgd_step"), [Int64; 5]);
    // params, grads, exp_avg, exp_avg_sq, n, scalars.
    assert_eq!(params(&optimizers, "adam_step"), [Int64; 6]);
    let augment = compile("augment");
    // indices, batch, seed, epoch (a pointer), padding, flip, draws.
    assert_eq!(
        params(&augment, "augment_draws"),
        [Int64, Int32, Int64, Int64, Int32, Int32, Int64]
    );
}

/// The C structs the optimizer kernels read from the step-scalar buffer have the layout the
/// host writes (`executor::scalars`, whose unit tests fix the byte of each field): their
/// sizes, their fields in this order (aggregate initialization follows declaration order;
/// all fields are 4 bytes, so no padding), and room in the buffer after the epoch; checked by
/// NVRTC's `static_assert`s, which a wrong size fails.
#[test]
fn the_scalar_structs_have_the_hosts_layout() {
    let Some(probe) = common::probe_with_nvrtc("the_scalar_structs_have_the_hosts_layout") else {
        return;
    };
    use tandem_cuda::executor::scalars::{
        AdamStepScalars, OptimizerScalars, SgdScalars, OPTIMIZER_OFFSET, STEP_SCALARS_BYTES,
    };
    use tandem_engine::{AdamConfig, SgdConfig};
    let sgd_config = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::with_lr(0.1)
    };
    let sgd = OptimizerScalars::Sgd(SgdScalars::new(&sgd_config, 0))
        .bytes()
        .len();
    let adam = OptimizerScalars::Adam(AdamStepScalars::new(&AdamConfig::with_lr(0.1), 1))
        .bytes()
        .len();
    let in_order = |name: &str, fields: &[&str]| {
        let values: Vec<String> = (0..fields.len()).map(|k| k.to_string()).collect();
        let checks: Vec<String> = fields
            .iter()
            .enumerate()
            .map(|(k, field)| format!("{name}_order.{field} == {k}"))
            .collect();
        format!(
            "constexpr {name} {name}_order{{{}}};\nstatic_assert({}, \"{name} field order\");\n",
            values.join(", "),
            checks.join(" && ")
        )
    };
    let order = in_order(
        "SgdScalars",
        &[
            "lr",
            "momentum",
            "dampening",
            "weight_decay",
            "nesterov",
            "first_step",
        ],
    ) + &in_order(
        "AdamScalars",
        &[
            "step_size",
            "beta2",
            "bias_correction2_sqrt",
            "eps",
            "weight_decay",
            "decay_factor",
            "lerp_weight",
            "sq_weight",
            "decoupled",
        ],
    );
    let compiler = Compiler::new(probe, GpuArch::SM_90, None).unwrap();
    let optimizers = tandem_cuda::kernels::kernel("optimizers").expect("optimizers.cu");
    let checked = |sgd_size: usize| {
        let source = format!(
            "{}\n{order}static_assert(sizeof(SgdScalars) == {sgd_size}, \"SgdScalars size\");\n\
             static_assert(sizeof(AdamScalars) == {adam}, \"AdamScalars size\");\n\
             static_assert({OPTIMIZER_OFFSET} % alignof(AdamScalars) == 0, \"alignment\");\n\
             static_assert({OPTIMIZER_OFFSET} + sizeof(AdamScalars) <= {STEP_SCALARS_BYTES}, \"room\");\n",
            optimizers.source
        );
        let kernel = KernelSource {
            name: "optimizers_layout",
            source: Box::leak(source.into_boxed_str()),
        };
        compiler.compile(&kernel).map(|_| ())
    };
    checked(sgd).unwrap_or_else(|error| panic!("{error}"));
    let error = checked(sgd + 4).unwrap_err();
    assert!(error.to_string().contains("SgdScalars size"), "{error}");
}
