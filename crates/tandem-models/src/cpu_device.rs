//! The CPU's training device: the model computes on its own host buffers with the CPU
//! executor, and a CPU optimizer updates them. A whole step is forward, backward and update,
//! the very calls of a step through the separate calls, so both give the same bits.

use tandem_engine::{BatchNormReducer, Optimizer, OptimizerConfig, OptimizerState};

use crate::training_device::{
    DatasetUpload, DeviceResult, GradientHook, StepConditions, StepReport, StepRequest, TrainBatch,
    TrainImages, TrainingDevice, TrainingDeviceError, Uploaded, WholeSteps,
};
use crate::{LossOptions, Model, ModelSpec};

/// A model on the CPU, with its optimizer.
pub struct CpuDevice {
    model: Model,
    optimizer: Option<Box<dyn Optimizer>>,
}

impl CpuDevice {
    /// Runs `model` on the CPU, without an optimizer until
    /// [`TrainingDevice::set_optimizer`].
    pub fn new(model: Model) -> Self {
        CpuDevice {
            model,
            optimizer: None,
        }
    }

    /// The optimizer, or an error when none was set up.
    fn optimizer(&mut self) -> DeviceResult<&mut Box<dyn Optimizer>> {
        self.optimizer
            .as_mut()
            .ok_or_else(|| TrainingDeviceError::unsupported("no optimizer was set up"))
    }
}

impl TrainingDevice for CpuDevice {
    fn spec(&self) -> &ModelSpec {
        self.model.spec()
    }

    fn param_count(&self) -> usize {
        self.model.params().len()
    }

    fn set_optimizer(&mut self, config: OptimizerConfig) {
        self.optimizer = Some(config.cpu(self.model.params().len()));
    }

    fn train_step(&mut self, request: StepRequest<'_>) -> DeviceResult<StepReport> {
        let count = request.micro_batches.len();
        if count == 0 {
            return Err(TrainingDeviceError::unsupported(
                "a training step needs at least one micro-batch",
            ));
        }
        let loss_scale = 1.0 / count as f32;
        self.zero_grads()?;
        let mut losses = Vec::with_capacity(count);
        for &micro_batch in request.micro_batches {
            let loss = self.forward_train(
                micro_batch,
                request.height,
                request.width,
                request.loss,
                None,
            )?;
            losses.push(loss);
            self.backward(loss_scale, None, None)?;
        }
        self.optimizer_step(request.lr, request.momentum)?;
        Ok(StepReport {
            losses,
            run: None,
            graphs_off: None,
            relaxed_capture: None,
        })
    }

    /// Whole steps in one process; a data-parallel step averages its gradients between the
    /// backward and the update, through the separate calls.
    fn whole_steps(&self, conditions: &StepConditions) -> WholeSteps {
        match conditions.data_parallel || conditions.sync_bn {
            true => WholeSteps::No,
            false => WholeSteps::Yes,
        }
    }

    fn zero_grads(&mut self) -> DeviceResult<()> {
        self.model.zero_grads();
        Ok(())
    }

    fn forward_train(
        &mut self,
        micro_batch: TrainBatch<'_>,
        height: usize,
        width: usize,
        loss: &LossOptions,
        bn_sync: Option<&mut dyn BatchNormReducer>,
    ) -> DeviceResult<f32> {
        let TrainImages::Host(images) = micro_batch.images else {
            return Err(TrainingDeviceError::unsupported(
                "images on the device need the model on a GPU",
            ));
        };
        Ok(self.model.forward_train(
            images,
            micro_batch.len(),
            height,
            width,
            micro_batch.labels,
            loss,
            bn_sync,
        )?)
    }

    fn backward(
        &mut self,
        loss_scale: f32,
        bn_sync: Option<&mut dyn BatchNormReducer>,
        grad_ready: Option<GradientHook<'_>>,
    ) -> DeviceResult<()> {
        let mut ignore = |_: std::ops::Range<usize>, _: &[f32]| {};
        let grad_ready = grad_ready.unwrap_or(&mut ignore);
        Ok(self.model.backward(loss_scale, bn_sync, grad_ready)?)
    }

    fn with_host_grads(&mut self, change: &mut dyn FnMut(&mut [f32])) -> DeviceResult<()> {
        change(self.model.grads_mut());
        Ok(())
    }

    fn optimizer_step(&mut self, lr: f64, momentum: Option<f64>) -> DeviceResult<()> {
        let optimizer = self
            .optimizer
            .as_mut()
            .ok_or_else(|| TrainingDeviceError::unsupported("no optimizer was set up"))?;
        optimizer.set_lr(lr as f32);
        if let Some(momentum) = momentum {
            optimizer.set_momentum(momentum as f32);
        }
        let (params, grads) = self.model.params_and_grads_mut();
        optimizer.step(params, grads);
        Ok(())
    }

    fn forward_eval(
        &mut self,
        images: &[f32],
        batch: usize,
        height: usize,
        width: usize,
    ) -> DeviceResult<&[f32]> {
        Ok(self.model.forward_eval(images, batch, height, width)?)
    }

    fn forward_eval_on_device(
        &mut self,
        _indices: &[usize],
        _height: usize,
        _width: usize,
    ) -> DeviceResult<&[f32]> {
        Err(TrainingDeviceError::unsupported(
            "the test set is in GPU memory only with the model on a GPU",
        ))
    }

    fn host_model(&mut self) -> DeviceResult<&Model> {
        Ok(&self.model)
    }

    fn update_host(&mut self, change: &mut dyn FnMut(&mut Model) -> bool) -> DeviceResult<()> {
        change(&mut self.model);
        Ok(())
    }

    fn optimizer_state(&mut self) -> DeviceResult<OptimizerState> {
        Ok(self.optimizer()?.state())
    }

    fn load_optimizer_state(&mut self, state: &OptimizerState) -> DeviceResult<()> {
        Ok(self.optimizer()?.load_state(state)?)
    }

    fn upload_train_set(&mut self, _upload: DatasetUpload<'_>) -> DeviceResult<Uploaded> {
        Ok(Uploaded::OnHost)
    }

    fn upload_eval_set(&mut self, _upload: DatasetUpload<'_>) -> DeviceResult<Uploaded> {
        Ok(Uploaded::OnHost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training_device::{update_host, with_host_grads, UploadPixels};
    use crate::ResNetBaseSpec;
    use tandem_engine::{AdamConfig, OptimizerConfig, Sgd, SgdConfig};

    fn small_model() -> Model {
        let spec = ResNetBaseSpec {
            n_blocks: vec![1, 1],
            n_channels: vec![4, 8],
            bottlenecks: None,
            ..ResNetBaseSpec::tutorial_default()
        };
        Model::new(&ModelSpec::ResNetBase(spec)).unwrap()
    }

    /// Images in about [-1, 1) and labels, from a fixed formula.
    fn batch(batch: usize) -> (Vec<f32>, Vec<u32>) {
        let images = (0..batch * 8 * 8 * 3)
            .map(|i| ((i as u64 * 2_654_435_761) % 2003) as f32 / 1001.5 - 1.0)
            .collect();
        let labels = (0..batch as u32).map(|i| (i * 7 + 3) % 10).collect();
        (images, labels)
    }

    fn nesterov() -> SgdConfig {
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 5e-4,
        }
    }

    fn device_with(config: OptimizerConfig) -> CpuDevice {
        let mut device = CpuDevice::new(small_model());
        device.set_optimizer(config);
        device
    }

    /// Two SGD steps through the separate calls give the bits of the model and optimizer
    /// driven directly, and the optimizer state round-trips.
    #[test]
    fn the_cpu_device_computes_exactly_what_the_model_does() {
        let config = nesterov();
        let (images, labels) = batch(4);
        let loss = LossOptions {
            label_smoothing: 0.1,
        };
        let mut direct = small_model();
        let mut optimizer = Sgd::new(direct.params().len(), config);
        let mut device = device_with(OptimizerConfig::Sgd(config));
        let micro_batch = TrainBatch {
            images: TrainImages::Host(&images),
            labels: &labels,
        };
        for step in 0..2 {
            let lr = 0.1 / f64::from(step + 1);
            direct.zero_grads();
            let expected = direct
                .forward_train(&images, 4, 8, 8, &labels, &loss, None)
                .unwrap();
            direct.backward(1.0, None, &mut |_, _| {}).unwrap();
            optimizer.set_lr(lr as f32);
            optimizer.set_momentum(0.8);
            let (params, grads) = direct.params_and_grads_mut();
            optimizer.step(params, grads);

            device.zero_grads().unwrap();
            let got = device
                .forward_train(micro_batch, 8, 8, &loss, None)
                .unwrap();
            let mut reported = 0;
            device
                .backward(1.0, None, Some(&mut |range, _| reported += range.len()))
                .unwrap();
            assert_eq!(reported, device.param_count());
            device.optimizer_step(lr, Some(0.8)).unwrap();
            assert_eq!(got.to_bits(), expected.to_bits(), "loss of step {step}");
        }
        let model = device.host_model().unwrap();
        assert_eq!(model.params(), direct.params());
        assert_eq!(model.buffers(), direct.buffers());
        assert_eq!(model.num_batches_tracked(), 2);
        let state = device.optimizer_state().unwrap();
        assert_eq!(state, optimizer.state());
        let eval = device.forward_eval(&images, 4, 8, 8).unwrap().to_vec();
        assert_eq!(eval, direct.forward_eval(&images, 4, 8, 8).unwrap());

        let mut fresh = device_with(OptimizerConfig::Sgd(config));
        fresh.load_optimizer_state(&state).unwrap();
        assert_eq!(fresh.optimizer_state().unwrap(), state);
        let wrong = OptimizerState {
            step: 1,
            slots: vec![("exp_avg".to_string(), vec![0.0; 3])],
        };
        let error = fresh.load_optimizer_state(&wrong).unwrap_err();
        assert!(error.to_string().contains("exp_avg"), "{error}");
        assert_eq!(
            fresh.optimizer_state().unwrap(),
            state,
            "a bad state changes nothing"
        );
    }

    /// A whole step of two micro-batches gives the bits of the separate calls: zeroed
    /// gradients, forward and backward at half the loss per micro-batch, one update.
    #[test]
    fn a_whole_cpu_step_is_the_separate_calls() {
        let (images, labels) = batch(8);
        let half = images.len() / 2;
        let micro_batches = [
            TrainBatch {
                images: TrainImages::Host(&images[..half]),
                labels: &labels[..4],
            },
            TrainBatch {
                images: TrainImages::Host(&images[half..]),
                labels: &labels[4..],
            },
        ];
        let loss = LossOptions {
            label_smoothing: 0.1,
        };
        let config = OptimizerConfig::Adam(AdamConfig::with_lr(0.01));
        let mut whole = device_with(config);
        let mut separate = device_with(config);
        for step in 0..2 {
            let report = whole
                .train_step(StepRequest {
                    micro_batches: &micro_batches,
                    height: 8,
                    width: 8,
                    loss: &loss,
                    lr: 0.01,
                    momentum: Some(0.85),
                })
                .unwrap();
            assert_eq!(report.run, None);
            separate.zero_grads().unwrap();
            let mut loss_sum = 0.0f64;
            for (micro_batch, &reported) in micro_batches.iter().zip(&report.losses) {
                let got = separate
                    .forward_train(*micro_batch, 8, 8, &loss, None)
                    .unwrap();
                assert_eq!(got.to_bits(), reported.to_bits(), "step {step}");
                loss_sum += got as f64;
                separate.backward(0.5, None, None).unwrap();
            }
            separate.optimizer_step(0.01, Some(0.85)).unwrap();
            assert_eq!(report.mean_loss().to_bits(), (loss_sum / 2.0).to_bits());
        }
        assert_eq!(
            whole.host_model().unwrap().params(),
            separate.host_model().unwrap().params()
        );
        assert_eq!(
            whole.host_model().unwrap().buffers(),
            separate.host_model().unwrap().buffers()
        );
        assert_eq!(whole.host_model().unwrap().num_batches_tracked(), 4);
        assert_eq!(
            whole.optimizer_state().unwrap(),
            separate.optimizer_state().unwrap()
        );
    }

    /// The CPU runs whole steps in one process only, has no NCCL, and keeps its data on the
    /// host.
    #[test]
    fn the_cpu_keeps_its_data_on_the_host_and_has_no_nccl() {
        let mut device = device_with(OptimizerConfig::Adam(AdamConfig::with_lr(0.01)));
        let single = StepConditions {
            data_parallel: false,
            sync_bn: false,
            nccl: false,
        };
        assert_eq!(device.whole_steps(&single), WholeSteps::Yes);
        let data_parallel = StepConditions {
            data_parallel: true,
            ..single
        };
        assert_eq!(device.whole_steps(&data_parallel), WholeSteps::No);
        let sync_bn = StepConditions {
            sync_bn: true,
            ..data_parallel
        };
        assert_eq!(device.whole_steps(&sync_bn), WholeSteps::No);
        let through_nccl = StepConditions {
            nccl: true,
            ..data_parallel
        };
        assert_eq!(through_nccl.refusal(), None);
        assert_eq!(device.whole_steps(&through_nccl), WholeSteps::No);
        assert!(!device.uses_nccl());
        assert_eq!(device.nccl_failure(), None);
        assert_eq!(
            device
                .sync_batch_norm_through_nccl()
                .unwrap_err()
                .to_string(),
            "SyncBatchNorm through NCCL needs the model on a GPU"
        );
        let pixels = vec![7u8; 2 * 8 * 8 * 3];
        let upload = DatasetUpload {
            pixels: UploadPixels::U8(&pixels),
            len: 2,
            height: 8,
            width: 8,
            channels: 3,
            crop_padding: 0,
            horizontal_flip: false,
            mean: [0.0; 3],
            std: [1.0; 3],
            seed: 0,
        };
        assert_eq!(device.upload_eval_set(upload).unwrap(), Uploaded::OnHost);
        assert_eq!(device.upload_train_set(upload).unwrap(), Uploaded::OnHost);
        let error = device.forward_eval_on_device(&[0, 1], 8, 8).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the test set is in GPU memory only with the model on a GPU"
        );
        let indices = [0, 1];
        let on_device = TrainBatch {
            images: TrainImages::OnDevice {
                indices: &indices,
                epoch: 0,
            },
            labels: &[0, 1],
        };
        let error = device
            .forward_train(on_device, 8, 8, &LossOptions::default(), None)
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "images on the device need the model on a GPU"
        );
        assert_eq!(device.host_model().unwrap().num_batches_tracked(), 0);
    }

    #[test]
    fn host_changes_and_host_gradients_reach_the_cpu_model() {
        let mut device = CpuDevice::new(small_model());
        update_host(&mut device, |model| {
            model.params_mut()[0] = 7.0;
            Ok::<_, TrainingDeviceError>(())
        })
        .unwrap();
        assert_eq!(device.host_model().unwrap().params()[0], 7.0);
        let failed = update_host(&mut device, |_| {
            Err::<(), _>(TrainingDeviceError::unsupported("no change"))
        });
        assert_eq!(failed.unwrap_err().to_string(), "no change");
        with_host_grads(&mut device, |grads| {
            grads.fill(0.25);
            Ok::<_, TrainingDeviceError>(())
        })
        .unwrap();
        assert!(device.model.grads().iter().all(|&grad| grad == 0.25));
        let error = device.optimizer_step(0.1, None).unwrap_err();
        assert_eq!(error.to_string(), "no optimizer was set up");
    }
}
