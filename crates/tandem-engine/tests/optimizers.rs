//! Optimizer update rules (values from PyTorch's formulas), state export/import and lr changes.

use tandem_engine::{Adam, AdamConfig, Optimizer, OptimizerState, Sgd, SgdConfig};

fn sgd_config(momentum: f32, nesterov: bool) -> SgdConfig {
    SgdConfig {
        momentum,
        nesterov,
        weight_decay: 0.01,
        ..SgdConfig::with_lr(0.1)
    }
}

#[test]
fn sgd_first_step_uses_the_gradient_as_momentum_buffer() {
    let mut optimizer = Sgd::new(2, sgd_config(0.9, false));
    let mut params = vec![1.0f32, -2.0];
    let grads = [0.5f32, 0.25];
    optimizer.step(&mut params, &grads);
    // g' = g + wd·p; buffer = g'; p -= lr·buffer.
    let g0 = [0.5 + 0.01 * 1.0, 0.25 + 0.01 * -2.0];
    let expected = [1.0 - 0.1 * g0[0], -2.0 - 0.1 * g0[1]];
    assert!((params[0] - expected[0]).abs() < 1e-7 && (params[1] - expected[1]).abs() < 1e-7);
    optimizer.step(&mut params, &grads);
    let g1 = [0.5 + 0.01 * expected[0], 0.25 + 0.01 * expected[1]];
    let buffer = [0.9 * g0[0] + g1[0], 0.9 * g0[1] + g1[1]];
    let expected = [expected[0] - 0.1 * buffer[0], expected[1] - 0.1 * buffer[1]];
    assert!(
        (params[0] - expected[0]).abs() < 1e-6 && (params[1] - expected[1]).abs() < 1e-6,
        "{params:?} vs {expected:?}"
    );
}

#[test]
fn sgd_nesterov_adds_momentum_times_buffer() {
    let mut optimizer = Sgd::new(
        1,
        SgdConfig {
            weight_decay: 0.0,
            ..sgd_config(0.5, true)
        },
    );
    let mut params = vec![0.0f32];
    optimizer.step(&mut params, &[1.0]);
    // buffer = 1; update = g + 0.5·buffer = 1.5.
    assert!((params[0] + 0.15).abs() < 1e-7);
}

#[test]
fn adam_first_step_moves_by_about_lr_and_adamw_decays_first() {
    let mut optimizer = Adam::new(2, AdamConfig::with_lr(0.01));
    let mut params = vec![1.0f32, 1.0];
    optimizer.step(&mut params, &[0.3, -2.0]);
    // Bias-corrected moments are g and g², so the step is lr·g/(|g| + eps).
    assert!((params[0] - (1.0 - 0.01 * 0.3 / (0.3 + 1e-8))).abs() < 1e-6);
    assert!((params[1] - (1.0 + 0.01 * 2.0 / (2.0 + 1e-8))).abs() < 1e-6);

    let mut adamw = Adam::new(
        1,
        AdamConfig {
            weight_decay: 0.1,
            decoupled: true,
            ..AdamConfig::with_lr(0.01)
        },
    );
    let mut params = vec![2.0f32];
    adamw.step(&mut params, &[0.5]);
    let expected = 2.0 * (1.0 - 0.01 * 0.1) - 0.01;
    assert!(
        (params[0] - expected).abs() < 1e-6,
        "{} vs {expected}",
        params[0]
    );

    let mut adam_l2 = Adam::new(
        1,
        AdamConfig {
            weight_decay: 0.1,
            ..AdamConfig::with_lr(0.01)
        },
    );
    let mut params = vec![2.0f32];
    adam_l2.step(&mut params, &[-0.1]);
    // g' = -0.1 + 0.1·2 = 0.1 > 0: the step goes down by lr.
    assert!((params[0] - (2.0 - 0.01)).abs() < 1e-6);
}

/// Runs `steps` steps with gradients depending on the step, from `params`.
fn run(optimizer: &mut dyn Optimizer, params: &mut [f32], steps: std::ops::Range<usize>) {
    for step in steps {
        let grads: Vec<f32> = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p * 0.3 + (i + step) as f32 * 0.1).sin())
            .collect();
        optimizer.step(params, &grads);
    }
}

fn resume_matches_uninterrupted(make: &dyn Fn() -> Box<dyn Optimizer>) {
    let start: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).cos()).collect();
    let mut uninterrupted = make();
    let mut expected = start.clone();
    run(uninterrupted.as_mut(), &mut expected, 0..5);

    let mut first = make();
    let mut params = start;
    run(first.as_mut(), &mut params, 0..3);
    let state = first.state();
    assert_eq!(state.step, 3);
    let mut resumed = make();
    resumed.load_state(&state).expect("state loads");
    run(resumed.as_mut(), &mut params, 3..5);
    assert_eq!(params, expected, "resumed run must be bit-identical");
}

#[test]
fn state_round_trip_resumes_bit_identically() {
    resume_matches_uninterrupted(&|| Box::new(Sgd::new(50, sgd_config(0.9, false))));
    resume_matches_uninterrupted(&|| Box::new(Sgd::new(50, sgd_config(0.9, true))));
    resume_matches_uninterrupted(&|| Box::new(Adam::new(50, AdamConfig::with_lr(0.01))));
    resume_matches_uninterrupted(&|| {
        Box::new(Adam::new(
            50,
            AdamConfig {
                weight_decay: 0.05,
                decoupled: true,
                ..AdamConfig::with_lr(0.01)
            },
        ))
    });
}

#[test]
fn state_slots_are_named_and_checked() {
    let adam = Adam::new(3, AdamConfig::with_lr(0.01));
    let state = adam.state();
    let names: Vec<&str> = state.slots.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["exp_avg", "exp_avg_sq"]);
    let sgd = Sgd::new(3, sgd_config(0.9, false));
    assert_eq!(sgd.state().slots[0].0, "momentum_buffer");
    assert!(Sgd::new(3, sgd_config(0.0, false)).state().slots.is_empty());

    let mut adam = Adam::new(3, AdamConfig::with_lr(0.01));
    let cases: [(&[(&str, usize)], &str); 3] = [
        (
            &[("exp_avg", 3)],
            "optimizer state has no slot `exp_avg_sq` (it has: exp_avg)",
        ),
        (
            &[("exp_avg", 3), ("exp_avg_sq", 2)],
            "optimizer state slot `exp_avg_sq` has 2 values, expected 3",
        ),
        (
            &[("momentum_buffer", 3)],
            "optimizer state has an unknown slot `momentum_buffer` (this optimizer keeps: exp_avg, exp_avg_sq)",
        ),
    ];
    for (slots, expected) in cases {
        let state = OptimizerState {
            step: 1,
            slots: slots
                .iter()
                .map(|&(name, len)| (name.to_string(), vec![0.0; len]))
                .collect(),
        };
        assert_eq!(adam.load_state(&state).unwrap_err().to_string(), expected);
    }
    assert_eq!(adam.state().step, 0, "a refused state changes nothing");
}

#[test]
fn learning_rate_can_change_between_steps() {
    let mut sgd = Sgd::new(1, SgdConfig::with_lr(0.1));
    let mut params = vec![0.0f32];
    sgd.step(&mut params, &[1.0]);
    sgd.set_lr(0.5);
    assert_eq!(sgd.lr(), 0.5);
    sgd.step(&mut params, &[1.0]);
    assert!((params[0] + 0.6).abs() < 1e-7);
}

#[test]
fn set_momentum_changes_sgd_momentum_but_not_plain_sgd() {
    let config = SgdConfig {
        weight_decay: 0.0,
        ..sgd_config(0.9, false)
    };
    let mut optimizer = Sgd::new(1, config);
    let mut params = vec![0.0f32];
    optimizer.step(&mut params, &[1.0]);
    optimizer.set_momentum(0.5);
    optimizer.step(&mut params, &[1.0]);
    // buffer = 1, then 0.5·1 + 1 = 1.5: p = -0.1 - 0.15.
    assert!((params[0] + 0.25).abs() < 1e-7, "{params:?}");

    let mut plain = Sgd::new(
        1,
        SgdConfig {
            momentum: 0.0,
            ..config
        },
    );
    plain.set_momentum(0.9);
    let mut params = vec![0.0f32];
    plain.step(&mut params, &[1.0]);
    plain.step(&mut params, &[1.0]);
    assert!(
        (params[0] + 0.2).abs() < 1e-7,
        "plain SGD gained momentum: {params:?}"
    );
    assert!(plain.state().slots.is_empty());
}

#[test]
fn set_momentum_sets_adam_beta1() {
    let mut cycled = Adam::new(1, AdamConfig::with_lr(0.01));
    let mut reference = Adam::new(
        1,
        AdamConfig {
            beta1: 0.5,
            ..AdamConfig::with_lr(0.01)
        },
    );
    cycled.set_momentum(0.5);
    let (mut a, mut b) = (vec![1.0f32], vec![1.0f32]);
    for grad in [0.3f32, -0.7, 0.2] {
        cycled.step(&mut a, &[grad]);
        reference.step(&mut b, &[grad]);
    }
    assert_eq!(a, b);
}
