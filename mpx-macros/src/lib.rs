//! Procedural macros of [mpx](https://docs.rs/mpx-dfdx) (the `mpx-dfdx` package, library `mpx`).
//! Use them through the `mpx` crate, which re-exports them (`mpx::mixed_step`, or
//! `mpx::prelude::*`); generated code names the runtime as `::mpx::__private` (override with
//! `crate = "path"`).
//!
//! Each macro lives in its own module as parse -> validate -> expand; the entry points below hold
//! only their docs, whose examples run as this crate's doc tests (it depends on the facade for
//! them, as users do).

use proc_macro::TokenStream;

mod autocast;
mod cast_derive;
mod ctxt;
#[cfg(test)]
mod expanded_examples;
mod full_precision;
mod half_layers;
mod mixed_step;
mod ops;
mod syntax;

/// Derives `mpx::cast::Cast<P>` and `mpx::cast::FloatLeaves` for a struct, so that
/// `mpx::cast::cast_to_half_precision` and friends, `mpx::finite::all_finite` and the loss
/// scales' unscaling reach its fields.
///
/// The struct's float type is a type parameter bounded by dfdx's `Dtype` (or the one named with
/// `#[cast(dtype = E)]`); casting to a precision `P` gives the same struct with that parameter
/// replaced by `P::Elem`. Every field is cast as its own type casts: float tensors and scalars
/// change, integer tensors (labels), `usize` counters and strings do not, containers (`Vec`,
/// `Option`, arrays, tuples, maps) and dfdx modules cast their contents.
///
/// Attributes, all optional:
/// - `#[cast(dtype = E)]` on the struct: the parameter to replace, when it is not the only one
///   bounded by `Dtype`;
/// - `#[cast(skip)]` on a field: cloned as it is (its type must be `Clone` and must not mention
///   the dtype parameter);
/// - `#[cast(crate = "path")]` on the struct: the `mpx` facade's path, for a renamed dependency.
///
/// Mistakes (an unknown key, no dtype parameter to replace, a skipped field that mentions it)
/// are reported together, each at its token.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx::cast::{cast_to_bf16, cast_to_f16};
/// use mpx::precision::f16;
///
/// #[derive(mpx::Cast)]
/// struct Batch<E: Dtype> {
///     x: Tensor<Rank2<2, 3>, E, Cpu>,
///     labels: Tensor<Rank1<2>, usize, Cpu>,
///     #[cast(skip)]
///     name: String,
/// }
///
/// let dev = Cpu::default();
/// let b = Batch::<f32> {
///     x: dev.tensor([[1.0, 2.0, 3.0], [65520.0, 1e-8, -1.0]]),
///     labels: dev.tensor([4, 9]),
///     name: "batch 0".into(),
/// };
/// let h: Batch<f16> = cast_to_f16(&b);
/// assert!(h.x.array()[1][0].is_infinite()); // past f16's max, 65504
/// assert_eq!(h.labels.array(), [4, 9]); // labels untouched
/// assert_eq!(h.name, "batch 0");
/// let r: Batch<f32> = cast_to_bf16(&b); // emulated bf16: f32 storage, bf16 values
/// assert_eq!(r.x.array()[0], [1.0, 2.0, 3.0]);
/// ```
#[proc_macro_derive(Cast, attributes(cast))]
pub fn derive_cast(input: TokenStream) -> TokenStream {
    cast_derive::expand(input.into()).into()
}

/// Derives `mpx::step::HalfLayers` for a module of the user's own, so that a mixed step's
/// working copy runs its layers as mpx's (fast f16 and bf16 kernels) while its forward code
/// stays as written: put `#[mpx::half_forward]` on each of its `Module` impls.
///
/// The module is generic over its element type (`E: Dtype`) and usually its device
/// (`D: Device<E>`), as dfdx's layers are. The derive writes `<Name>Working<consts.., H>`: each
/// layer field as its mapped working copy, each tensor field of the element type in `H`'s
/// element type, every other field (a temperature, a counter, a `usize` index tensor or a `bool`
/// mask, its device as `Cpu`) cloned as it is, so every setting is carried; what a `forward_mut`
/// pass changes in those comes back to the module. A field of a named type other than those is
/// taken for a layer (a module of the user's own, `ReLU`), as is a tuple of layers.
///
/// Attributes, all optional:
/// - `#[half_layers(state)]` on a tensor field its `TensorCollection` does not train (a running
///   statistic; a mismatch with the module's own walk is an error when the step runs);
/// - `#[half_layers(keep)]` on a field to carry as it is (a settings struct or an enum of the
///   user's own: no layer);
/// - `#[half_layers(dtype = E, device = D, crate = "path")]` on the struct, when the parameters
///   cannot be told from their bounds, or for a renamed dependency.
///
/// # Examples
/// ```
/// use dfdx::nn::modules::{Linear, ReLU};
/// use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
/// use dfdx::{optim::*, prelude::*};
/// use mpx::step::GradScaler;
///
/// #[derive(Clone, mpx::HalfLayers)]
/// struct Mlp<E: Dtype, D: Device<E>> {
///     l1: Linear<4, 8, E, D>,
///     act: ReLU,
///     l2: Linear<8, 2, E, D>,
///     temperature: f32,
/// }
///
/// impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
///     TensorCollection<E, D> for Mlp<E, D>
/// {
///     type To<E2: Dtype, D2: Device<E2>> = Mlp<E2, D2>;
///     fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
///         visitor: &mut V,
///     ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
///         visitor.visit_fields(
///             (
///                 Self::module("l1", |s| &s.l1, |s| &mut s.l1),
///                 Self::module("l2", |s| &s.l2, |s| &mut s.l2),
///             ),
///             |(l1, l2)| Mlp { l1, act: ReLU, l2, temperature: 2.0 },
///         )
///     }
/// }
///
/// #[mpx::half_forward]
/// impl<E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<Rank2<3, 4>, E, D, T>> for Mlp<E, D> {
///     type Output = Tensor<Rank2<3, 2>, E, D, T>;
///     type Error = D::Err;
///     fn try_forward(&self, x: Tensor<Rank2<3, 4>, E, D, T>) -> Result<Self::Output, D::Err> {
///         let h = self.act.try_forward(self.l1.try_forward(x)?)?;
///         let t = E::from_f32(1.0 / self.temperature).unwrap();
///         self.l2.try_forward(h)?.try_mul(t)
///     }
/// }
///
/// #[mpx::mixed_step(scaling = scaler)]
/// fn step(model: &mut Mlp<f32, Cpu>, opt: &mut Sgd<Mlp<f32, Cpu>, f32, Cpu>, x: &Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
///     let grads = model.forward(x.trace(model.alloc_grads())).square().mean().backward();
///     opt.update(model, &grads).unwrap();
/// }
///
/// let dev: Cpu = Default::default();
/// let mut model = Mlp::<f32, Cpu>::build(&dev);
/// let mut opt = Sgd::new(&model, Default::default());
/// let mut scaler = GradScaler::default();
/// step(&mut model, &mut opt, &dev.sample_normal(), &mut scaler);
/// // the step ran on mpx's layers, in f16
/// assert!(scaler.last_step().unwrap().mpx_layers);
/// ```
#[proc_macro_derive(HalfLayers, attributes(half_layers))]
pub fn derive_half_layers(input: TokenStream) -> TokenStream {
    half_layers::derive(input.into()).into()
}

/// Runs a module's `Module` (or `ModuleMut`) impl, as written, on the working copy
/// `#[derive(HalfLayers)]` gives it: the same impl for `<Name>Working` in f16, `AMP<f16>` and
/// emulated bf16, with the element type and the device made concrete (what `E: Dtype` brings
/// keeps working, `E::from_f32(..)`, `E::ONE`, `E::to_f32(&x)`, as does `D::Err`). In that code the operations of autocast's float32 list (the table
/// `#[autocast]` wraps: `softmax`, `log_softmax`, `exp`, `ln`, `sum`, `mean`, the losses, ..)
/// run in f32 on their inputs widened, rounded back once, a chain of them in one region, as
/// `#[autocast]` runs them (in emulated bf16, whose storage is f32, as written). The impl must
/// be written for any element type. Put it on each of the module's `Module` impls, and on each
/// inherent impl that holds a helper method the forward code calls (`self.encode(x)` in a
/// `Module` impl needs `#[half_forward] impl<E: Dtype, D: Device<E>> Net<E, D> { fn encode(..) }`:
/// the working struct has the method only then, and rustc says "no method named `encode` found
/// for `&NetWorking<f16>`" without it; the working struct gets the impl's methods and constants,
/// not its functions without `self`, such as a constructor).
///
/// # Examples
/// See [`HalfLayers`](derive@HalfLayers).
#[proc_macro_attribute]
pub fn half_forward(args: TokenStream, item: TokenStream) -> TokenStream {
    half_layers::attribute(args.into(), item.into()).into()
}

/// Runs the body of a function in f32 inside a half-precision graph, gradients flowing through:
/// mpx's `force_full_precision`.
///
/// The function's tensor arguments are split off their tape, copied to f32 and traced on a tape
/// of their own; the body runs on them as written for f32; its result is cast back to **the
/// caller's** half type `H` (mpx always returns f16, a trap in bf16 mode), and one backward op
/// carries the gradients of the inputs, and of the parameters named in `params`, back into the
/// half graph. With `H = f32` the function is bit-identical to the same function without the
/// attribute, forward and gradients. The runtime form, for writing it by hand, is
/// `mpx::region::FullPrecision::<H>::run(x, |x| ..)` (`run_with` for a module's parameters).
///
/// Accepted forms: a free function or a method; one tensor argument, several, or tuples of
/// tensors; other arguments are captured unchanged. The body becomes a closure returning the
/// tensor, so it must not use `?` or `return`.
///
/// Arguments, all optional:
/// - `half = H`: the caller's precision (`H`, `f16`, `AMP<f16>`, `bf16`, `f32`); found
///   automatically when exactly one type parameter is bounded by `Precision` or `HalfPrecision`;
///   needed on a method whose `H` belongs to the `impl`;
/// - `params = ln` (an argument or a field of `self`): a module whose parameters the body uses;
///   the body sees an f32 copy, and its gradients go to the module's own gradient entries;
/// - `inputs = x` or `inputs = (x, y)`: the arguments to cast, when their type is an alias the
///   macro cannot see through (it recognises `Tensor<..>` and tuples of them);
/// - `crate = "path"`: the `mpx` facade's path, for a renamed dependency.
///
/// Every mistake is reported at its token, together, and the function is kept as written so the
/// rest of the crate still compiles. CPU only. See also [`macro@autocast`], which wraps only the
/// precision-critical calls of a body.
///
/// # Examples
/// A log-sum-exp whose exponentials overflow f16 (e^12 = 162755 > 65504), run in f32 inside an
/// f16 graph:
/// ```
/// use dfdx::prelude::*;
/// use mpx::full_precision;
/// use mpx::precision::{Precision, f16};
///
/// #[full_precision]
/// fn log_sum_exp<H: Precision, T: Tape<H::Elem, Cpu>>(
///     x: Tensor<Rank1<3>, H::Elem, Cpu, T>,
/// ) -> Tensor<Rank0, H::Elem, Cpu, T>
/// where
///     Cpu: Device<H::Elem>,
/// {
///     x.exp().sum::<Rank0, _>().ln()
/// }
///
/// let dev = Cpu::default();
/// let x = dev.tensor([12.0f32, 11.0, 10.0]).to_dtype::<f16>();
/// let y = log_sum_exp::<f16, _>(x.leaky_trace());
/// assert!((y.array().to_f32() - 12.41).abs() < 0.01);
/// let grads = y.backward(); // gradients flow back into the f16 graph: the softmax of x
/// let g = grads.get(&x).array().map(f16::to_f32);
/// assert!((g[0] - 0.665).abs() < 0.01);
/// // The same body without the attribute overflows.
/// assert!(x.exp().sum::<Rank0, _>().ln().array().is_infinite());
/// ```
///
/// A layer norm whose parameters the region uses (`params`): a row summing past 65504 is inf in
/// f16, so its mean runs in f32:
/// ```
/// use dfdx::prelude::*;
/// use mpx::full_precision;
/// use mpx::precision::{Precision, f16};
///
/// type Ln<E> = dfdx::nn::modules::LayerNorm1D<4, E, Cpu>;
///
/// #[full_precision(params = ln)]
/// fn layer_norm<H: Precision, T: Tape<H::Elem, Cpu>>(
///     ln: &Ln<H::Elem>,
///     x: Tensor<Rank2<2, 4>, H::Elem, Cpu, T>,
/// ) -> Tensor<Rank2<2, 4>, H::Elem, Cpu, T>
/// where
///     Cpu: Device<H::Elem>,
/// {
///     ln.forward(x)
/// }
///
/// let dev = Cpu::default();
/// let ln = dev.build_module::<LayerNorm1D<4>, f16>();
/// let x = dev.tensor([[30000.0f32, 30000.0, 30000.0, 1.0], [1.0, 2.0, 3.0, 4.0]]);
/// let y = layer_norm::<f16, _>(&ln, x.to_dtype::<f16>().leaky_trace());
/// assert!(y.array().iter().flatten().all(|v| v.is_finite()));
/// ```
#[proc_macro_attribute]
pub fn full_precision(args: TokenStream, item: TokenStream) -> TokenStream {
    full_precision::expand(args.into(), item.into()).into()
}

/// Turns an f32 dfdx training step (or a loop of them) into the mixed-precision recipe: the
/// attribute and a scaler are the only changes.
///
/// The macro finds the step's roles wherever they stand (in loops, branches and closures,
/// through `?`, `unwrap` and `try_` forms) and rewrites those calls alone:
///
/// | the f32 code | becomes |
/// |---|---|
/// | `model.forward_mut(x.traced(grads))` (any forward of the master on a traced input) | the forward pass on the scaler's half working copy of the f32 master; its output is f32 again |
/// | `loss.backward()` / `loss.try_backward()` | the loss scaled, the half gradients unscaled with the scale that was applied, checked, and added to the master's f32 gradients |
/// | `opt.update(model, &grads)` | the update of the f32 master, run only when every backward pass since the last update was finite; the loss scale adjusted once |
///
/// Everything else (gradient allocation, the loss, logging, `zero_grads`) is the user's f32
/// code, untouched: the loss and its scaling never enter the half graph.
///
/// Arguments:
/// - `scaling = place` (required): a `mpx::step::GradScaler` (or `&mut GradScaler`) place,
///   declared once outside the loop: a parameter, a field (`self.scaler`), a local. It holds the
///   loss scale, the working copy and the skip counters; read `scaler.last_step()` after a step;
/// - `half = f16 | amp_f16 | bf16 | f32` (optional): pins the precision; without it, the
///   scaler's type decides (`GradScaler<f16>` by default);
/// - `crate = "path"` (optional): the `mpx` facade's path, for a renamed dependency.
///
/// A step whose code names dfdx's `Cuda` device (feature `cuda`, `docs/gpu.md`) runs its
/// forward passes on `Cuda`; any other runs on the `Cpu`. A step generic over its dtype and
/// device (dfdx's `generic-train-loop`) converts too: the macro specialises it to an f32 master
/// on the `Cpu` (on `Cuda` when the step also names `Cuda`). A model built in a half type where the
/// f32 master belongs is a compile error at the model that says to keep the master in f32.
/// Every mistake is reported at its token, together, and the function is kept as written so the
/// rest of the crate still compiles. `examples/mixed_step-expanded.rs` shows one expansion in
/// full.
///
/// # Examples
/// One step; the scaler is a parameter:
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx::mixed_step;
/// use mpx::scaling::DynamicLossScale;
/// use mpx::step::{GradScaler, UpdateOutcome};
///
/// type Mlp = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
///
/// #[mixed_step(scaling = scaler)]
/// fn step(
///     model: &mut Model,
///     opt: &mut Sgd<Model, f32, Cpu>,
///     x: Tensor<Rank2<3, 4>, f32, Cpu>,
///     y: Tensor<Rank2<3, 2>, f32, Cpu>,
///     scaler: &mut GradScaler,
/// ) -> Result<f32, Box<dyn std::error::Error>> {
///     let grads = model.alloc_grads();
///     let loss = mse_loss(model.forward_mut(x.traced(grads)), y);
///     let value = loss.array();
///     let grads = loss.try_backward()?;
///     opt.update(model, &grads)?;
///     Ok(value)
/// }
///
/// let dev = Cpu::default();
/// let mut model = dev.build_module::<Mlp, f32>();
/// let mut opt = Sgd::new(&model, Default::default());
/// // 2^20 overflows f16 on the first step: that step is skipped and the scale backs off.
/// let mut scaler = GradScaler::new(DynamicLossScale::new(1048576.0)?);
/// let (x, y) = (dev.sample_normal(), dev.sample_normal());
/// step(&mut model, &mut opt, x, y, &mut scaler)?;
/// let report = scaler.last_step().unwrap();
/// assert!(matches!(report.outcome, UpdateOutcome::Skipped { .. }));
/// assert_eq!(report.new_scale, 524288.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A loop in a struct, in emulated bf16 (`half = bf16`; the scaler is a field):
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx::mixed_step;
/// use mpx::precision::bf16;
/// use mpx::scaling::DynamicLossScale;
/// use mpx::step::GradScaler;
///
/// type Model = <Linear<2, 1> as BuildOnDevice<Cpu, f32>>::Built;
///
/// struct Trainer {
///     model: Model,
///     opt: Sgd<Model, f32, Cpu>,
///     scaler: GradScaler<bf16>,
/// }
///
/// impl Trainer {
///     #[mixed_step(scaling = self.scaler, half = bf16)]
///     fn epoch(&mut self, batches: &[(Tensor<Rank2<4, 2>, f32, Cpu>, Tensor<Rank2<4, 1>, f32, Cpu>)]) {
///         let mut grads = self.model.alloc_grads();
///         for (x, y) in batches {
///             let loss = mse_loss(self.model.forward_mut(x.trace(grads)), y.clone());
///             grads = loss.backward();
///             self.opt.update(&mut self.model, &grads).unwrap();
///             self.model.zero_grads(&mut grads);
///         }
///     }
/// }
///
/// let dev = Cpu::default();
/// let model = dev.build_module::<Linear<2, 1>, f32>();
/// let opt = Sgd::new(&model, Default::default());
/// let mut t = Trainer { model, opt, scaler: GradScaler::new(DynamicLossScale::default()) };
/// let batches = vec![(dev.sample_normal(), dev.sample_normal()); 3];
/// t.epoch(&batches);
/// assert_eq!(t.scaler.applied_steps() + t.scaler.skipped_steps(), 3);
/// ```
#[proc_macro_attribute]
pub fn mixed_step(args: TokenStream, item: TokenStream) -> TokenStream {
    mixed_step::expand(args.into(), item.into()).into()
}

/// Runs each precision-critical operation of a function in f32, inside a half-precision graph:
/// compile-time autocast.
///
/// Every call of an operation of PyTorch autocast's f32 list, in dfdx's names (the losses;
/// `softmax`, `log_softmax`, `logsumexp`, `exp`, `ln`, `sum`, `mean`, `var`, `stddev`,
/// `normalize`, `powf`, `powi`, `recip` and their `try_` forms), becomes a full-precision region,
/// `mpx::region::FullPrecision::<H>::run(x, |x| x.op(..))`: its tensors are copied to f32, the
/// operation runs in f32 and its result comes back in the caller's half type `H`, gradients
/// flowing through. The rest of the body (matmuls, adds, activations) is untouched and runs in
/// `H`. A chain of operations (`x.exp().sum()`) is one region; a loss's prediction and target
/// enter together. With `H = f32` the function is bit-identical to the same function without the
/// attribute, forward and gradients.
///
/// Arguments, all optional: `half = H` (the caller's precision; found automatically when one type
/// parameter is bounded by `Precision` or `HalfPrecision`; needed on an `impl Module` method whose
/// `H` belongs to the `impl`), `skip = (sum, ..)` (operations to leave in `H`), `crate = "path"`
/// (the `mpx` facade's path). A method whose receiver cannot be a tensor (a literal, a range,
/// `self` or its fields, an iterator: `v.iter().sum()`) is left alone; write a scalar method as a
/// path call (`f32::exp(v)`) or use `skip` to keep any other call out. CPU only. See
/// `docs/dsl.md`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx::autocast;
/// use mpx::precision::{Precision, f16};
///
/// // Layer norm's statistics: a row summing past 65504 overflows f16 without the attribute.
/// #[autocast]
/// fn norm_then_scale<H: Precision, T: Tape<H::Elem, Cpu>>(
///     x: Tensor<Rank2<2, 4>, H::Elem, Cpu, T>,
///     w: Tensor<Rank2<2, 4>, H::Elem, Cpu>,
/// ) -> Tensor<Rank2<2, 4>, H::Elem, Cpu, T>
/// where
///     Cpu: Device<H::Elem>,
/// {
///     x.normalize::<Axis<1>>(1e-5) * w // normalize runs in f32, the product in H
/// }
///
/// let dev = Cpu::default();
/// let x = dev.tensor([[30000.0f32, 30000.0, 30000.0, 1.0], [1.0, 2.0, 3.0, 4.0]]);
/// let w: Tensor<Rank2<2, 4>, f32, Cpu> = dev.ones();
/// let y = norm_then_scale::<f16, _>(x.clone().to_dtype::<f16>(), w.to_dtype::<f16>());
/// assert!(y.as_vec().iter().all(|v| v.is_finite()));
/// let plain = x.to_dtype::<f16>().normalize::<Axis<1>>(1e-5);
/// assert!(plain.as_vec().iter().any(|v| !v.is_finite()));
/// ```
#[proc_macro_attribute]
pub fn autocast(args: TokenStream, item: TokenStream) -> TokenStream {
    autocast::expand(args.into(), item.into()).into()
}
