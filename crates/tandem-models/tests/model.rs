//! Model structure (names, shapes, layout), whole-model gradients, determinism, the
//! SyncBatchNorm hook, input checks and weights I/O.

use std::collections::BTreeMap;

use tandem_engine::rng::Rng;
use tandem_engine::{Optimizer, Sgd, SgdConfig};
use tandem_models::{
    load_named_tensors, load_safetensors, save_safetensors, BatchNormReducer, LossOptions, Model,
    ModelError, ModelSpec, NamedTensor, ResNetBaseSpec, TensorData, TensorKind,
};

fn small_spec(bottlenecks: Option<Vec<usize>>) -> ModelSpec {
    ModelSpec::ResNetBase(ResNetBaseSpec {
        n_blocks: vec![1, 2],
        n_channels: vec![4, 6],
        bottlenecks,
        first_kernel_size: 3,
        img_channels: 3,
        num_classes: 5,
    })
}

fn random_batch(batch: usize, size: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = Rng::new(seed);
    let images = (0..batch * size * size * 3)
        .map(|_| rng.uniform(-1.0, 1.0))
        .collect();
    let labels = (0..batch).map(|i| (i * 3 % 5) as u32).collect();
    (images, labels)
}

/// `model`'s training forward over `batch` 8x8 `images` of `labels`, with the default loss
/// and `bn_sync`.
fn forward_8x8(
    model: &mut Model,
    images: &[f32],
    batch: usize,
    labels: &[u32],
    bn_sync: Option<&mut dyn BatchNormReducer>,
) -> Result<f32, ModelError> {
    model.forward_train(
        images,
        batch,
        8,
        8,
        labels,
        &LossOptions::default(),
        bn_sync,
    )
}

/// `tensors` without the one named `name`.
fn without(tensors: &[NamedTensor], name: &str) -> Vec<NamedTensor> {
    let mut kept = tensors.to_vec();
    kept.retain(|tensor| tensor.name != name);
    kept
}

/// `tensors` and one more, of one value, named `name`.
fn with_one_more(tensors: &[NamedTensor], name: &str) -> Vec<NamedTensor> {
    let mut more = tensors.to_vec();
    more.push(NamedTensor {
        name: name.into(),
        shape: vec![1],
        data: TensorData::F32(vec![0.0]),
    });
    more
}

fn shape_of(model: &Model, name: &str) -> Vec<usize> {
    model
        .tensor_info(name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .shape
        .clone()
}

#[test]
fn resnet18_state_dict_names_and_shapes() {
    let model = Model::new(&ModelSpec::ResNet18 { num_classes: 10 }).unwrap();
    let names: Vec<&str> = model.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        &names[..7],
        [
            "conv1.0.weight",
            "conv1.1.weight",
            "conv1.1.bias",
            "conv1.1.running_mean",
            "conv1.1.running_var",
            "conv1.1.num_batches_tracked",
            "conv2.0.residual_function.0.weight"
        ]
    );
    assert_eq!(names.last(), Some(&"dense_layer.bias"));
    assert_eq!(shape_of(&model, "conv1.0.weight"), [64, 3, 3, 3]);
    assert_eq!(
        shape_of(&model, "conv3.0.shortcut.0.weight"),
        [128, 64, 1, 1]
    );
    assert_eq!(
        shape_of(&model, "conv5.1.residual_function.3.weight"),
        [512, 512, 3, 3]
    );
    assert_eq!(shape_of(&model, "dense_layer.weight"), [10, 512]);
    assert!(
        model.tensor_info("conv2.0.shortcut.0.weight").is_none(),
        "identity shortcut has no conv"
    );
    assert!(
        model.tensor_info("conv1.0.bias").is_none(),
        "seed 000 convs have no bias"
    );
    assert_eq!(
        shape_of(&model, "conv1.1.num_batches_tracked"),
        Vec::<usize>::new()
    );
    // 11,173,962 parameters, as torchvision-style CIFAR ResNet-18 with 10 classes.
    assert_eq!(model.params().len(), 11_173_962);
    assert_eq!(names.len(), 122);
}

#[test]
fn resnet_base_state_dict_names_and_shapes() {
    let model = Model::new(&ModelSpec::ResNetBase(ResNetBaseSpec::tutorial_default())).unwrap();
    assert_eq!(shape_of(&model, "0.conv.weight"), [16, 3, 3, 3]);
    assert_eq!(shape_of(&model, "0.conv.bias"), [16]);
    assert_eq!(shape_of(&model, "0.blocks.0.conv1.weight"), [8, 16, 1, 1]);
    assert_eq!(
        shape_of(&model, "0.blocks.0.shortcut.conv.weight"),
        [16, 16, 1, 1]
    );
    assert_eq!(shape_of(&model, "0.blocks.3.conv2.bias"), [8]);
    assert_eq!(shape_of(&model, "0.blocks.6.shortcut.bn.running_var"), [32]);
    assert_eq!(shape_of(&model, "0.blocks.17.conv3.weight"), [64, 16, 1, 1]);
    assert_eq!(shape_of(&model, "1.weight"), [10, 64]);
    assert!(model
        .tensor_info("0.blocks.1.shortcut.conv.weight")
        .is_none());
    let plain = Model::new(&small_spec(None)).unwrap();
    assert_eq!(shape_of(&plain, "0.blocks.0.conv2.weight"), [4, 4, 3, 3]);
    assert!(plain.tensor_info("0.blocks.0.conv3.weight").is_none());
    assert_eq!(
        shape_of(&plain, "0.blocks.1.shortcut.conv.weight"),
        [6, 4, 1, 1]
    );
}

#[test]
fn spec_errors_name_the_field() {
    let mut spec = ResNetBaseSpec::tutorial_default();
    spec.n_channels = vec![16, 32];
    let error = Model::new(&ModelSpec::ResNetBase(spec)).err().unwrap();
    assert_eq!(
        error.to_string(),
        "invalid model spec: n_channels: has 2 entries, n_blocks has 3"
    );
    let mut spec = ResNetBaseSpec::tutorial_default();
    spec.bottlenecks = Some(vec![8]);
    let error = Model::new(&ModelSpec::ResNetBase(spec)).err().unwrap();
    assert_eq!(
        error.to_string(),
        "invalid model spec: bottlenecks: has 1 entries, n_channels has 3"
    );
    let error = Model::new(&ModelSpec::ResNet18 { num_classes: 0 })
        .err()
        .unwrap();
    assert_eq!(
        error.to_string(),
        "invalid model spec: num_classes: must be at least 1"
    );
}

#[test]
fn default_init_follows_pytorch_bounds_and_seed() {
    let mut model = Model::new(&small_spec(Some(vec![2, 3]))).unwrap();
    model.init_default(7);
    let first = model.params().to_vec();
    model.init_default(7);
    assert_eq!(model.params(), &first[..], "same seed, same weights");
    model.init_default(8);
    assert_ne!(model.params(), &first[..]);
    let weight = model.tensor_values("0.blocks.1.conv2.weight").unwrap(); // fan_in 3·3·3 = 27
    let bound = 1.0 / 27f32.sqrt();
    assert!(weight.iter().all(|w| w.abs() <= bound));
    assert!(weight.iter().any(|w| w.abs() > 0.8 * bound));
    assert!(model
        .tensor_values("0.bn.weight")
        .unwrap()
        .iter()
        .all(|&w| w == 1.0));
    assert!(model
        .tensor_values("0.bn.running_var")
        .unwrap()
        .iter()
        .all(|&v| v == 1.0));
    assert!(model
        .tensor_values("0.bn.running_mean")
        .unwrap()
        .iter()
        .all(|&v| v == 0.0));
}

#[test]
fn layout_converts_conv_weights_to_oihw() {
    let mut model = Model::new(&small_spec(None)).unwrap();
    let info = model.tensor_info("0.conv.weight").unwrap().clone();
    let values: Vec<f32> = (0..info.len).map(|i| i as f32).collect();
    assert!(model.set_tensor_values("0.conv.weight", &values));
    assert_eq!(model.tensor_values("0.conv.weight").unwrap(), values);
    // Stored OHWI: element (o=0, ky=0, kx=1, i=0) is OIHW index 1.
    assert_eq!(model.params()[info.offset + 3], 1.0);
    assert!(!model.set_tensor_values("0.conv.weight", &values[1..]));
}

/// The model's loss as a function of its flat parameters, for finite differences.
fn loss_at(model: &mut Model, params: &[f32], images: &[f32], labels: &[u32], size: usize) -> f64 {
    model.params_mut().copy_from_slice(params);
    let options = LossOptions {
        label_smoothing: 0.1,
    };
    let loss = model
        .forward_train(images, labels.len(), size, size, labels, &options, None)
        .unwrap();
    f64::from(loss)
}

/// Whole-model backward against central differences at 60 random parameters. ReLU kinks
/// make a difference quotient wrong when a step crosses one, so each parameter is tried
/// with three steps and the closest one counts (both converge to the gradient as steps shrink).
fn whole_model_gradient(spec: ModelSpec) {
    let size = 16;
    let mut model = Model::new(&spec).unwrap();
    model.init_default(3);
    let (images, labels) = random_batch(4, size, 11);
    let params = model.params().to_vec();
    model.zero_grads();
    loss_at(&mut model, &params, &images, &labels, size);
    model.backward(1.0, None, &mut |_, _| {}).unwrap();
    let analytic = model.grads().to_vec();
    let scale = f64::from(analytic.iter().fold(0.0f32, |m, g| m.max(g.abs())));
    let mut rng = Rng::new(5);
    let mut worst = 0.0f64;
    for _ in 0..60 {
        let index = (rng.next_u64() % params.len() as u64) as usize;
        let mut closest = f64::INFINITY;
        for step in [1e-3f32, 3e-4, 1e-4] {
            let mut shifted = params.clone();
            shifted[index] += step;
            let up = loss_at(&mut model, &shifted, &images, &labels, size);
            shifted[index] -= 2.0 * step;
            let down = loss_at(&mut model, &shifted, &images, &labels, size);
            let numeric = (up - down) / (2.0 * f64::from(step));
            closest = closest.min((numeric - f64::from(analytic[index])).abs() / scale);
        }
        worst = worst.max(closest);
    }
    assert!(worst < 5e-3, "whole-model gradient differs from finite differences by {worst:.3e} of the largest gradient");
}

#[test]
fn whole_model_gradients_match_finite_differences_bottleneck() {
    whole_model_gradient(small_spec(Some(vec![2, 3])));
}

#[test]
fn whole_model_gradients_match_finite_differences_plain_blocks() {
    whole_model_gradient(small_spec(None));
}

#[test]
fn gradient_accumulation_scales_and_adds() {
    let mut model = Model::new(&small_spec(Some(vec![2, 3]))).unwrap();
    let (images, labels) = random_batch(4, 8, 12);
    model.zero_grads();
    forward_8x8(&mut model, &images, 4, &labels, None).unwrap();
    model.backward(1.0, None, &mut |_, _| {}).unwrap();
    let once = model.grads().to_vec();
    model.zero_grads();
    for _ in 0..2 {
        forward_8x8(&mut model, &images, 4, &labels, None).unwrap();
        model.backward(0.5, None, &mut |_, _| {}).unwrap();
    }
    for (a, b) in model.grads().iter().zip(&once) {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "two half-scaled backward passes must add up to one"
        );
    }
    assert_eq!(
        model
            .backward(1.0, None, &mut |_, _| {})
            .unwrap_err()
            .to_string(),
        "backward needs a forward_train first (each forward_train allows one backward)"
    );
}

fn train_few_steps(seed: u64) -> Vec<f32> {
    let mut model = Model::new(&small_spec(Some(vec![2, 3]))).unwrap();
    model.init_default(seed);
    let mut optimizer = Sgd::new(
        model.params().len(),
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 5e-4,
        },
    );
    for step in 0..3 {
        let (images, labels) = random_batch(6, 8, 100 + step);
        model.zero_grads();
        forward_8x8(&mut model, &images, 6, &labels, None).unwrap();
        model.backward(1.0, None, &mut |_, _| {}).unwrap();
        let (params, grads) = model.params_and_grads_mut();
        optimizer.step(params, grads);
    }
    let mut result = model.params().to_vec();
    result.extend_from_slice(model.buffers());
    result
}

#[test]
fn same_seed_and_data_give_bit_identical_weights() {
    tandem_engine::set_threads(2);
    assert_eq!(train_few_steps(9), train_few_steps(9));
}

/// A reducer standing for `replicas` processes that all hold the same batch.
struct Replicas {
    replicas: f64,
    calls: usize,
}

impl BatchNormReducer for Replicas {
    fn all_reduce_sum(
        &mut self,
        values: &mut [f64],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.calls += 1;
        values.iter_mut().for_each(|v| *v *= self.replicas);
        Ok(())
    }
}

struct Failing;

impl BatchNormReducer for Failing {
    fn all_reduce_sum(
        &mut self,
        _values: &mut [f64],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Err("peer 1 went away".into())
    }
}

#[test]
fn sync_batchnorm_over_identical_replicas_matches_local() {
    let spec = small_spec(Some(vec![2, 3]));
    let (images, labels) = random_batch(4, 8, 13);
    let mut local = Model::new(&spec).unwrap();
    let mut synced = Model::new(&spec).unwrap();
    let loss_local = forward_8x8(&mut local, &images, 4, &labels, None).unwrap();
    let mut reducer = Replicas {
        replicas: 2.0,
        calls: 0,
    };
    let loss_synced = forward_8x8(&mut synced, &images, 4, &labels, Some(&mut reducer)).unwrap();
    let batch_norms = local
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("running_mean"))
        .count();
    assert_eq!(
        reducer.calls, batch_norms,
        "one all-reduce per batch norm in the forward"
    );
    assert!((loss_local - loss_synced).abs() <= 1e-6 * loss_local.abs());
    local.backward(1.0, None, &mut |_, _| {}).unwrap();
    synced
        .backward(1.0, Some(&mut reducer), &mut |_, _| {})
        .unwrap();
    assert_eq!(
        reducer.calls,
        2 * batch_norms,
        "one all-reduce per batch norm in the backward"
    );
    for (a, b) in local.grads().iter().zip(synced.grads()) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()));
    }
    // Running variance uses the global count: var·2n/(2n−1) instead of var·n/(n−1).
    let n = 4.0 * 4.0 * 4.0; // 4 images of 4x4 after the stride-2 stem.
    let local_var = local.tensor_values("0.bn.running_var").unwrap();
    let synced_var = synced.tensor_values("0.bn.running_var").unwrap();
    for (l, s) in local_var.iter().zip(&synced_var) {
        let batch_var = f64::from(l - 0.9) / 0.1 * (n - 1.0) / n;
        let expected = 0.9 + 0.1 * batch_var * 2.0 * n / (2.0 * n - 1.0);
        assert!((f64::from(*s) - expected).abs() < 1e-5);
    }
    let error = forward_8x8(&mut synced, &images, 4, &labels, Some(&mut Failing)).unwrap_err();
    assert_eq!(
        error.to_string(),
        "batch norm statistics all-reduce failed: peer 1 went away"
    );
}

#[test]
fn input_errors_name_the_input() {
    let mut model = Model::new(&small_spec(None)).unwrap();
    let (images, labels) = random_batch(2, 8, 14);
    let error = forward_8x8(&mut model, &images[1..], 2, &labels, None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "images has 383 values, expected 384 (NHWC [2, 8, 8, 3])"
    );
    let error = forward_8x8(&mut model, &images, 2, &labels[..1], None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "labels has 1 values, expected 2 (one per image of a batch of 2)"
    );
    let error = forward_8x8(&mut model, &images, 2, &[0, 5], None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "label 5 of sample 1 is not a class index (0..5)"
    );
    let error = model.forward_eval(&[], 2, 1, 0).unwrap_err();
    assert_eq!(
        error.to_string(),
        "images are too small: layer `0.conv` gets a 1x0 input, smaller than its kernel"
    );
    let error = model.forward_eval(&[], 0, 8, 8).unwrap_err();
    assert!(matches!(error, ModelError::EmptyBatch), "{error}");
}

#[test]
fn eval_does_not_disturb_a_pending_backward_and_uses_running_stats() {
    let mut model = Model::new(&small_spec(Some(vec![2, 3]))).unwrap();
    let (images, labels) = random_batch(4, 8, 15);
    let (other, _) = random_batch(3, 8, 16);
    forward_8x8(&mut model, &images, 4, &labels, None).unwrap();
    model.backward(1.0, None, &mut |_, _| {}).unwrap();
    let reference = model.grads().to_vec();
    let buffers = model.buffers().to_vec();
    model.zero_grads();
    forward_8x8(&mut model, &images, 4, &labels, None).unwrap();
    let eval_first = model.forward_eval(&other, 3, 8, 8).unwrap().to_vec();
    model.backward(1.0, None, &mut |_, _| {}).unwrap();
    assert_eq!(model.grads(), &reference[..]);
    // Eval of one image alone gives the same logits as within a batch: no batch statistics.
    let single = model
        .forward_eval(&other[..8 * 8 * 3], 1, 8, 8)
        .unwrap()
        .to_vec();
    assert_eq!(single.len(), 5);
    for (a, b) in single.iter().zip(&eval_first[..5]) {
        assert!((a - b).abs() < 1e-5);
    }
    assert_ne!(
        model.buffers(),
        &buffers[..],
        "the second train forward updated running stats"
    );
}

#[test]
fn safetensors_round_trip_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let spec = small_spec(Some(vec![2, 3]));
    let mut model = Model::new(&spec).unwrap();
    model.init_default(21);
    let (images, labels) = random_batch(2, 8, 17);
    forward_8x8(&mut model, &images, 2, &labels, None).unwrap();
    forward_8x8(&mut model, &images, 2, &labels, None).unwrap();
    let metadata = BTreeMap::from([("epoch".to_string(), "3".to_string())]);
    save_safetensors(&model, &path, &metadata).unwrap();
    let mut loaded = Model::new(&spec).unwrap();
    let read_metadata = load_safetensors(&mut loaded, &path).unwrap();
    assert_eq!(read_metadata, metadata);
    assert_eq!(loaded.params(), model.params());
    assert_eq!(loaded.buffers(), model.buffers());
    assert_eq!(loaded.num_batches_tracked(), 2);
    assert_eq!(
        loaded.forward_eval(&images, 2, 8, 8).unwrap(),
        model.forward_eval(&images, 2, 8, 8).unwrap()
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "no temporary file left: {leftovers:?}");
}

#[test]
fn a_symbolic_link_at_the_temporary_name_is_refused_and_its_target_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    let temporary = dir
        .path()
        .join(format!("weights.safetensors.{}.tmp", std::process::id()));
    std::os::unix::fs::symlink(&victim, &temporary).unwrap();
    let mut model = Model::new(&small_spec(None)).unwrap();
    model.init_default(3);
    let error = save_safetensors(&model, &path, &BTreeMap::new()).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "cannot write {}: cannot create its temporary file {}",
            path.display(),
            temporary.display()
        )
    );
    let reason = std::error::Error::source(&error).expect("the reason");
    assert_eq!(
        reason.to_string(),
        format!(
            "the name is taken already, by a symbolic link to {}; tandem writes only files it \
             creates: remove it",
            victim.display()
        )
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(std::fs::symlink_metadata(&temporary)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(!path.exists());
}

/// The model's state as named tensors (PyTorch layout), like a torch.save state_dict.
fn named_tensors(model: &Model, prefix: &str) -> Vec<NamedTensor> {
    model
        .tensors()
        .iter()
        .map(|info| NamedTensor {
            name: format!("{prefix}{}", info.name),
            shape: info.shape.clone(),
            data: match info.kind {
                TensorKind::BatchCount => TensorData::I64(vec![model.num_batches_tracked() as i64]),
                _ => TensorData::F32(model.tensor_values(&info.name).unwrap()),
            },
        })
        .collect()
}

#[test]
fn named_tensors_load_with_prefix_and_errors_name_the_tensor() {
    let spec = small_spec(None);
    let mut source = Model::new(&spec).unwrap();
    source.init_default(31);
    source.set_num_batches_tracked(7);
    let tensors = named_tensors(&source, "module.");
    let mut target = Model::new(&spec).unwrap();
    load_named_tensors(&mut target, &tensors, Some("module.")).unwrap();
    assert_eq!(target.params(), source.params());
    assert_eq!(target.num_batches_tracked(), 7);

    let before = target.params().to_vec();
    let missing = without(&tensors, "module.0.blocks.1.bn2.running_var");
    let error = load_named_tensors(&mut target, &missing, Some("module.")).unwrap_err();
    assert_eq!(
        error.to_string(),
        "tensor list: tensor `0.blocks.1.bn2.running_var` is missing"
    );
    let extra = with_one_more(&tensors, "module.fc.weight");
    let error = load_named_tensors(&mut target, &extra, Some("module.")).unwrap_err();
    assert_eq!(
        error.to_string(),
        "tensor list: unexpected tensor `module.fc.weight` (not in this model's state_dict)"
    );
    let mut wrong = tensors.clone();
    wrong[0].shape = vec![4, 3, 3, 1];
    let error = load_named_tensors(&mut target, &wrong, Some("module.")).unwrap_err();
    assert_eq!(
        error.to_string(),
        "tensor list: tensor `module.0.conv.weight` has shape [4, 3, 3, 1], expected [4, 3, 3, 3]"
    );
    assert_eq!(
        target.params(),
        &before[..],
        "a refused load changes nothing"
    );
}

#[test]
fn safetensors_with_missing_extra_or_misshaped_tensor_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let spec = small_spec(None);
    let source = Model::new(&spec).unwrap();
    let write = |name: &str, tensors: Vec<NamedTensor>| {
        let path = dir.path().join(name);
        let owned: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = tensors
            .into_iter()
            .map(|t| match t.data {
                TensorData::F32(v) => (
                    t.name,
                    t.shape,
                    safetensors::Dtype::F32,
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ),
                TensorData::I64(v) => (
                    t.name,
                    t.shape,
                    safetensors::Dtype::I64,
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ),
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = owned
            .iter()
            .map(|(name, shape, dtype, bytes)| {
                (
                    name.clone(),
                    safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        path
    };
    let tensors = named_tensors(&source, "");
    let mut target = Model::new(&spec).unwrap();
    // Why loading `tensors` written as `file` fails, after the file's path.
    let mut refusal = |file: &str, tensors: Vec<NamedTensor>| {
        let path = write(file, tensors);
        let error = load_safetensors(&mut target, &path)
            .unwrap_err()
            .to_string();
        let prefix = format!("{}: ", path.display());
        assert!(error.starts_with(&prefix), "{error}");
        error[prefix.len()..].to_string()
    };
    assert_eq!(
        refusal("missing.safetensors", without(&tensors, "1.bias")),
        "tensor `1.bias` is missing"
    );
    assert_eq!(
        refusal("extra.safetensors", with_one_more(&tensors, "2.weight")),
        "unexpected tensor `2.weight` (not in this model's state_dict)"
    );
    let mut wrong = tensors.clone();
    let last = wrong.len() - 2;
    wrong[last].shape = vec![6, 5];
    assert_eq!(
        refusal("wrong.safetensors", wrong),
        "tensor `1.weight` has shape [6, 5], expected [5, 6]"
    );
    let mut wrong_dtype = tensors;
    let count = wrong_dtype
        .iter()
        .position(|t| t.name == "0.bn.num_batches_tracked")
        .unwrap();
    wrong_dtype[count].data = TensorData::F32(vec![0.0]);
    assert_eq!(
        refusal("dtype.safetensors", wrong_dtype),
        "tensor `0.bn.num_batches_tracked` has dtype F32, expected I64"
    );
}
