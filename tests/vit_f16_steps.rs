//! The ViT of `examples/vit.rs` (`DigitsVit` of `common/digits.rs`: `mpx::nn` encoder blocks with their
//! layer norms and attention softmax in f32) trains for a few steps in mixed f16 on the real
//! digits without NaN: a loss scale that starts far too high (2^24) makes the first steps
//! overflow; those are skipped, counted, and leave the master untouched, and every applied step's
//! loss tracks an f32 run that applies the same updates on the same batches.

mod common;
use common::digits;

use dfdx::{optim::*, prelude::*};
use digits::{CLASSES, Digits, DigitsVit, FEATURES};
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;
use mpx::step::{GradScaler, Mixed, UpdateOutcome};

const BATCH: usize = 16;
const STEPS: usize = 16;
type Images = Tensor<Rank2<BATCH, FEATURES>, f32, Cpu>;
type Labels = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu>;

fn batches(dev: &Cpu, d: &Digits) -> Vec<(Images, Labels)> {
    d.epoch_order(0)
        .chunks_exact(BATCH)
        .take(STEPS)
        .map(|idx| d.train_batch::<BATCH>(dev, idx))
        .collect()
}

/// Every parameter value of the model, in visiting order.
fn values(m: &DigitsVit<f32, Cpu>) -> Vec<f32> {
    let mut out = Vec::new();
    mpx::cast::module_visit_floats::<f32, _>(m, &mut |bits| {
        if let mpx::precision::FloatSlice::F32(v) = bits {
            out.extend_from_slice(v);
        }
        true
    });
    out
}

#[test]
fn vit_trains_in_f16_with_skipped_steps_counted() {
    let d = Digits::load(0.2, 7);
    let dev = Cpu::seed_from_u64(3);
    let init = dev.build_module::<DigitsVit, f32>();
    let cfg = AdamConfig {
        lr: 3e-3,
        ..Default::default()
    };

    // Mixed f16 run.
    let mut master = Mixed::mapped(init.clone());
    let mut opt = Adam::new(&*master, cfg);
    let initial_scale = 2f32.powi(24);
    let mut scaler = GradScaler::<f16, _>::new(
        DynamicLossScale::builder()
            .initial(initial_scale)
            .period(1000)
            .build()
            .unwrap(),
    );
    let mut applied = Vec::new(); // (step, loss) of each applied step
    let mut skipped = 0u64;
    for (step, (x, y)) in batches(&dev, &d).iter().enumerate() {
        let before = values(&master);
        let out = scaler
            .forward(&master, x.clone().trace(master.alloc_grads()), |m, x| {
                m.forward(x)
            })
            .unwrap();
        let loss = cross_entropy_with_logits_loss(out, y.clone());
        let value = loss.array();
        let grads = scaler.backward(loss).unwrap();
        let loss = value;
        assert!(loss.is_finite(), "step {step}: the f32 loss is {loss}");
        match scaler.update(&mut master, &mut opt, &grads).unwrap() {
            UpdateOutcome::Applied => applied.push((step, loss)),
            _ => {
                skipped += 1;
                assert_eq!(
                    values(&master),
                    before,
                    "step {step}: a skipped step changed the master"
                );
            }
        }
    }
    assert!(skipped >= 1, "a scale of 2^24 overflows f16 at first");
    assert!(applied.len() >= 5, "only {} steps applied", applied.len());
    assert_eq!(scaler.skipped_steps(), skipped);
    assert_eq!(scaler.applied_steps(), applied.len() as u64);
    assert!(scaler.loss_scale() < initial_scale, "the scale backed off");
    assert!(
        values(&master).iter().all(|v| v.is_finite()),
        "master finite"
    );

    // f32 reference: the same updates (the applied steps' batches, in order) from the same weights.
    let mut model = init.clone();
    let mut opt32 = Adam::new(&model, cfg);
    let all = batches(&dev, &d);
    let mut grads = model.alloc_grads();
    let mut max_gap = 0.0f32;
    for &(step, loss16) in &applied {
        let (x, y) = &all[step];
        let out = model.forward(x.clone().traced(grads));
        let loss = cross_entropy_with_logits_loss(out, y.clone());
        let loss32 = loss.array();
        // f16 keeps 11 significant bits (a relative step of 2^-11, about 5e-4). The logits pass
        // two encoder blocks and a handful of updates in f16, so the loss near 2.3 may drift by a
        // few such steps (seen: 5e-4); 5e-3 allows about 10 of them, far below the gap a wrong
        // update or a mis-scaled gradient opens (a single skipped Adam step moves it by ~1e-2).
        assert!(
            (loss16 - loss32).abs() < 5e-3,
            "step {step}: f16 loss {loss16} vs f32 loss {loss32}"
        );
        max_gap = max_gap.max((loss16 - loss32).abs());
        grads = loss.backward();
        opt32.update(&mut model, &grads).unwrap();
        model.zero_grads(&mut grads);
    }
    eprintln!(
        "{skipped} skipped, {} applied, scale now {}, largest |f16 loss - f32 loss| {max_gap:.2e}, loss {} -> {}",
        applied.len(),
        scaler.loss_scale(),
        applied[0].1,
        applied[applied.len() - 1].1
    );
    // The applied steps trained: the last loss is below the first.
    let (first, last) = (applied[0].1, applied[applied.len() - 1].1);
    assert!(last < first, "loss went from {first} to {last}");
}
