//! The rules of `--device`: pure functions of the probe's findings, the GPU count and the
//! local rank, tested on made-up facts.

use tandem_cuda::device::{
    ordinal_for_local_rank, resolve, Device, DeviceError, DeviceRequest, GpuFacts, VisibleDevice,
    VisibleDevices,
};
use tandem_cuda::{Library, MissingLibrary};

fn missing_driver() -> MissingLibrary {
    MissingLibrary {
        library: Library::Driver,
        places: "the system's search".to_string(),
        names: vec!["libcuda.so".to_string(), "libcuda.so.1".to_string()],
        dlopen_error: "libcuda.so.1: cannot open shared object file: No such file or directory"
            .to_string(),
    }
}

/// Facts of a machine with every library and `gpus` GPUs.
fn gpu_machine(gpus: usize) -> GpuFacts {
    GpuFacts {
        missing_library: None,
        visible_gpus: Ok(gpus),
        visible_devices: VisibleDevices::All,
    }
}

fn cpu_machine() -> GpuFacts {
    GpuFacts {
        missing_library: Some(missing_driver()),
        visible_gpus: Err(missing_driver().to_string()),
        visible_devices: VisibleDevices::All,
    }
}

#[test]
fn device_values_parse_and_print() {
    for (text, request) in [
        ("auto", DeviceRequest::Auto),
        ("cpu", DeviceRequest::Cpu),
        ("cuda", DeviceRequest::Cuda(None)),
        ("cuda:0", DeviceRequest::Cuda(Some(0))),
        ("cuda:12", DeviceRequest::Cuda(Some(12))),
    ] {
        assert_eq!(text.parse::<DeviceRequest>().unwrap(), request);
        assert_eq!(request.to_string(), text);
    }
    // The DDP tutorial's `--device gpu` means cuda.
    assert_eq!(
        "gpu".parse::<DeviceRequest>(),
        Ok(DeviceRequest::Cuda(None))
    );
    assert_eq!(
        "gpu:3".parse::<DeviceRequest>(),
        Ok(DeviceRequest::Cuda(Some(3)))
    );
    for npu in ["npu", "npu:0"] {
        let error = npu.parse::<DeviceRequest>().unwrap_err().to_string();
        assert_eq!(
            error,
            format!(
                "device `{npu}`: Tandem does not run on Ascend NPUs (the DDP tutorial's npu with \
                 hccl); use cuda (NVIDIA GPUs, with nccl) or cpu"
            )
        );
    }
    for bad in [
        "gpus", "gpu:", "cuda:", "cuda:-1", "cuda:x", "CUDA", "cuda:+1", "",
    ] {
        let error = bad.parse::<DeviceRequest>().unwrap_err().to_string();
        assert!(
            error.contains(&format!("`{bad}`")) && error.contains("auto, cpu, cuda, cuda:N"),
            "{error}"
        );
    }
    assert_eq!(DeviceRequest::default(), DeviceRequest::Auto);
}

#[test]
fn cpu_is_the_cpu_everywhere() {
    for facts in [cpu_machine(), gpu_machine(2)] {
        assert_eq!(
            resolve(DeviceRequest::Cpu, &facts, Some(1)).unwrap(),
            Device::Cpu {
                reason: "requested".to_string()
            }
        );
    }
}

#[test]
fn auto_without_the_driver_takes_the_cpu_and_says_why() {
    let device = resolve(DeviceRequest::Auto, &cpu_machine(), None).unwrap();
    let line = device.to_string();
    assert_eq!(
        line,
        "cpu (auto: libcuda not found (libcuda.so.1); `--device cuda` says where it looked)"
    );
}

#[test]
fn cuda_without_a_library_is_an_error_naming_it() {
    for request in [DeviceRequest::Cuda(None), DeviceRequest::Cuda(Some(0))] {
        let error = resolve(request, &cpu_machine(), None).unwrap_err();
        assert_eq!(error, DeviceError::MissingLibrary(missing_driver()));
        assert!(error
            .to_string()
            .starts_with("libcuda not found: searched the system's search"));
    }
}

#[test]
fn auto_takes_the_cpu_where_no_gpu_can_be_used_and_says_why() {
    // On a machine without a usable GPU (this one, CI's), auto takes the CPU, for the reason
    // the probe or the driver gives.
    let facts = GpuFacts::gather(tandem_cuda::Probe::process());
    if facts.missing_library.is_some() || !matches!(facts.visible_gpus, Ok(n) if n > 0) {
        let device = resolve(DeviceRequest::Auto, &facts, None).unwrap();
        let Device::Cpu { reason } = device else {
            panic!("auto took a GPU that is not there: {device}");
        };
        assert!(reason.starts_with("auto: "), "{reason}");
    }
}

#[test]
fn with_an_executor_local_rank_r_takes_gpu_r_modulo_the_visible_gpus() {
    let facts = gpu_machine(3);
    for (rank, ordinal) in [(0, 0), (1, 1), (2, 2), (3, 0), (7, 1)] {
        for request in [DeviceRequest::Auto, DeviceRequest::Cuda(None)] {
            assert_eq!(
                resolve(request, &facts, Some(rank)).unwrap(),
                Device::Cuda {
                    ordinal,
                    reason: format!("local rank {rank} of 3 visible GPU(s)")
                }
            );
        }
    }
    assert_eq!(
        resolve(DeviceRequest::Auto, &facts, None)
            .unwrap()
            .to_string(),
        "cuda:0 (first of 3 visible GPU(s))"
    );
    // cuda:N names the GPU whatever the rank.
    assert_eq!(
        resolve(DeviceRequest::Cuda(Some(2)), &facts, Some(0)).unwrap(),
        Device::Cuda {
            ordinal: 2,
            reason: "requested".to_string()
        }
    );
}

#[test]
fn cuda_n_beyond_the_visible_gpus_is_an_error() {
    let error = resolve(DeviceRequest::Cuda(Some(2)), &gpu_machine(2), None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "cuda:2 asked for, but only 2 GPU(s) are visible (cuda:0 to cuda:1)"
    );
}

#[test]
fn no_visible_gpu_says_whether_cuda_visible_devices_hid_them() {
    let mut facts = gpu_machine(0);
    let error = resolve(DeviceRequest::Cuda(None), &facts, None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no GPU is visible: the driver reports 0 GPUs"
    );
    facts.visible_devices = VisibleDevices::parse(Some(""));
    let error = resolve(DeviceRequest::Cuda(None), &facts, None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no GPU is visible: CUDA_VISIBLE_DEVICES is set and lists no device"
    );
    assert!(matches!(
        resolve(DeviceRequest::Auto, &facts, None).unwrap(),
        Device::Cpu { reason } if reason == "auto: no GPU is visible: CUDA_VISIBLE_DEVICES is set and lists no device"
    ));
    facts.visible_gpus = Err("cuInit failed: CUDA_ERROR_NO_DEVICE".to_string());
    let error = resolve(DeviceRequest::Cuda(None), &facts, None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no GPU is visible: cuInit failed: CUDA_ERROR_NO_DEVICE"
    );
}

#[test]
fn cuda_visible_devices_parses_as_the_driver_reads_it() {
    use VisibleDevice::{Index, Uuid};
    assert_eq!(VisibleDevices::parse(None), VisibleDevices::All);
    assert_eq!(
        VisibleDevices::parse(Some("")),
        VisibleDevices::Listed(vec![])
    );
    assert!(VisibleDevices::parse(Some("")).hides_all());
    assert_eq!(
        VisibleDevices::parse(Some("2,0")),
        VisibleDevices::Listed(vec![Index(2), Index(0)])
    );
    assert_eq!(
        VisibleDevices::parse(Some(" 1 , GPU-8f3a-12,MIG-GPU-8f3a/1/0")),
        VisibleDevices::Listed(vec![
            Index(1),
            Uuid("GPU-8f3a-12".to_string()),
            Uuid("MIG-GPU-8f3a/1/0".to_string())
        ])
    );
    // The list ends at the first entry that is neither a number nor a UUID.
    assert_eq!(
        VisibleDevices::parse(Some("0,-1,1")),
        VisibleDevices::Listed(vec![Index(0)])
    );
    assert!(VisibleDevices::parse(Some("-1")).hides_all());
    assert!(!VisibleDevices::parse(Some("0")).hides_all());
}

#[test]
fn local_ranks_wrap_around_the_visible_gpus() {
    assert_eq!(ordinal_for_local_rank(0, 1), Some(0));
    assert_eq!(ordinal_for_local_rank(5, 1), Some(0));
    assert_eq!(ordinal_for_local_rank(5, 4), Some(1));
    assert_eq!(ordinal_for_local_rank(3, 8), Some(3));
    assert_eq!(ordinal_for_local_rank(0, 0), None);
}
