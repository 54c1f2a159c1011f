//! `#[mixed_step]`: parse ([`ast`], the roles called by path read as method calls:
//! [`path_calls`]) -> validate ([`valid`], with the roles of the body found by [`roles`]) ->
//! expand ([`expand`]).

mod ast;
mod expand;
mod generic;
mod path_calls;
mod roles;
mod valid;

use proc_macro2::TokenStream;

use crate::ctxt::expand_fn;

/// Entry point: the rewritten step, or the errors followed by the user's item unchanged.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    expand_fn(
        (
            "mixed_step",
            "a function that trains: a traced forward pass of the model, a backward pass and an optimizer update (a loop of them is fine)",
        ),
        (args, item),
        ast::parse_args,
        |args, f, cx| {
            let f = path_calls::as_method_calls(f?);
            Some((valid::check(args, &f, cx)?, f))
        },
        |args, (plan, f)| expand::expand(args, plan, f),
    )
}

#[cfg(test)]
mod tests {
    use crate::ctxt::testing::{items, messages};
    use proc_macro2::TokenStream;
    use quote::quote;

    /// dfdx's own MNIST loop: gradients allocated once, the step inside a `for` loop.
    fn mnist_loop() -> TokenStream {
        quote!(
            fn train(
                model: &mut Model,
                opt: &mut Adam<Model, f32, Cpu>,
                data: Data,
                scaler: &mut GradScaler,
            ) {
                let mut grads = model.alloc_grads();
                for (img, lbl) in data {
                    let logits = model.forward_mut(img.traced(grads));
                    let loss = cross_entropy_with_logits_loss(logits, lbl);
                    total += loss.array();
                    grads = loss.backward();
                    opt.update(model, &grads).unwrap();
                    model.zero_grads(&mut grads);
                }
            }
        )
    }

    fn flat(out: &TokenStream) -> String {
        out.to_string().replace(' ', "")
    }

    #[test]
    fn a_crate_path_with_generic_arguments_is_an_error_at_the_literal() {
        for bad in ["a::<T>", "my::mpx<u8>"] {
            let out = super::expand(quote!(scaling = scaler, crate = #bad), mnist_loop());
            let m = messages(&out);
            assert_eq!(m.len(), 1, "{out}");
            assert!(m[0].contains("without generic arguments"), "{m:?}");
        }
        let out = super::expand(quote!(scaling = scaler, crate = "::my::mpx"), mnist_loop());
        assert!(messages(&out).is_empty(), "{out}");
    }

    #[test]
    fn rewrites_the_roles_and_nothing_else() {
        let out = super::expand(quote!(scaling = scaler, half = f16), mnist_loop());
        assert!(messages(&out).is_empty(), "{out}");
        let s = flat(&out);
        for want in [
            // the signature and return type are untouched
            "fntrain(model:&mutModel,opt:&mutAdam<Model,f32,Cpu>,data:Data,scaler:&mutGradScaler,){",
            // the masters' state: one local of the step
            "let__mpx_masters=::mpx::__private::mpx_runtime::__private::Masters::new();",
            "letmutgrads=model.alloc_grads();",
            // forward: the traced input as written (a batch nothing reads the gradient of, as
            // `grads` comes from `alloc_grads` and backward passes), the master as held
            "let__mpx_input=::mpx::__private::mpx_runtime::step::Batch(img.traced(grads));",
            "__private::forward::<_,_,_,_,_,::mpx::__private::mpx_runtime::__private::call::ForwardMut,::mpx::__private::mpx_runtime::__private::fallback::Reject>(::mpx::__private::mpx_runtime::__private::scaler_of::<::mpx::__private::mpx_runtime::precision::f16,_>((scaler).__mpx_by_mut()),&__mpx_masters,(model).__mpx_master_mut(),__mpx_input,))",
            ".__mpx_forward(|__mpx_working,__mpx_x|__mpx_working.forward_mut(__mpx_x))",
            // the loss is plain f32 code
            "letloss=cross_entropy_with_logits_loss(logits,lbl);",
            "total+=loss.array();",
            // backward and update through the scaler; the user's unwrap stays
            "grads={let__mpx_loss=loss;",
            "__private::backward(::mpx::__private::mpx_runtime::__private::scaler_of",
            "__mpx_loss,|__mpx_loss|__mpx_loss.backward())}",
            // the update: the scaler's two halves around the step's own call, as written
            "static__MPX_SITE:u8=0;",
            "__private::begin_update(::mpx::__private::mpx_runtime::__private::scaler_of::<::mpx::__private::mpx_runtime::precision::f16,_>((scaler).__mpx_by_mut()),&__mpx_masters,(model).__mpx_master_mut(),&__MPX_SITE);",
            "::core::option::Option::Some((opt).update(model,__mpx_grads))",
            "__private::end_update(::mpx::__private::mpx_runtime::__private::scaler_of",
            ",__mpx_verdict,__mpx_ran)",
            // zero_grads is dfdx's own
            "model.zero_grads(&mutgrads);",
        ] {
            assert!(s.contains(want), "missing {want}\nin {s}");
        }
    }

    #[test]
    fn a_step_that_names_cuda_gets_a_cuda_scaler() {
        let cuda = quote!(
            fn train(model: &mut Model, opt: &mut Adam<Model, f32, Cuda>, data: Data) {
                let mut scaler = GradScaler::default();
                let mut grads = model.alloc_grads();
                for (img, lbl) in data {
                    let logits = model.forward_mut(img.traced(grads));
                    grads = cross_entropy_with_logits_loss(logits, lbl).backward();
                    opt.update(model, &grads).unwrap();
                    model.zero_grads(&mut grads);
                }
            }
        );
        let out = super::expand(quote!(scaling = scaler, half = f16), cuda);
        assert!(messages(&out).is_empty(), "{out}");
        let s = flat(&out);
        let on_cuda = "letmutscaler:::mpx::__private::mpx_runtime::step::GradScaler<::mpx::__private::mpx_runtime::precision::f16,::mpx::__private::mpx_runtime::scaling::DynamicLossScale,::mpx::__private::mpx_runtime::__dfdx::tensor::Cuda>=GradScaler::default();";
        assert!(s.contains(on_cuda), "{s}");
    }

    #[test]
    fn without_half_the_f32_fallback_warns_and_a_leaky_step_keeps_its_batch_gradient() {
        let out = super::expand(
            quote!(scaling = scaler),
            quote!(
                fn train(model: &mut Model, opt: &mut O, x: X, scaler: &mut GradScaler) {
                    let g = model.forward(x.leaky_trace()).mean().backward();
                    opt.update(model, &g).unwrap();
                }
            ),
        );
        let s = flat(&out);
        assert!(s.contains("__private::fallback::Warn>"), "{s}");
        assert!(s.contains("let__mpx_input=x.leaky_trace();"), "{s}");
        // gradients handed in by the caller may keep the batch's: computed
        let out = super::expand(
            quote!(scaling = scaler),
            quote!(
                fn train(model: &mut Model, opt: &mut O, x: X, g: Grads, scaler: &mut GradScaler) {
                    let g = model.forward(x.traced(g)).mean().backward();
                    opt.update(model, &g).unwrap();
                }
            ),
        );
        assert!(flat(&out).contains("let__mpx_input=x.traced(g);"), "{out}");
    }

    #[test]
    fn staged_forward_on_fields_of_self_and_an_untraced_evaluation() {
        let out = super::expand(
            quote!(scaling = self.scaler, half = bf16, crate = "m"),
            quote!(
                fn step(&mut self, ids: Ids, x_test: X) -> Result<f32, StepError> {
                    let h = self
                        .model
                        .embed
                        .try_forward(ids.traced(self.gradients.take()))?;
                    let out = self.model.head.forward(h);
                    let test_out = self.model.forward(x_test);
                    let loss = mse_loss(out, y) + l2(&self.model);
                    self.gradients = loss.try_backward()?;
                    self.opt.update(&mut self.model, &self.gradients)?;
                    Ok(loss_value)
                }
            ),
        );
        assert!(messages(&out).is_empty(), "{out}");
        let s = flat(&out);
        assert!(
            s.contains("|__mpx_working,__mpx_x|__mpx_working.embed.try_forward(__mpx_x)"),
            "{s}"
        );
        assert!(
            s.contains("|__mpx_working,__mpx_x|__mpx_working.head.forward(__mpx_x)"),
            "{s}"
        );
        // the untraced evaluation stays on the f32 master
        assert!(s.contains("lettest_out=self.model.forward(x_test);"), "{s}");
        assert!(
            s.contains("m::__private::mpx_runtime::precision::bf16"),
            "{s}"
        );
        assert!(
            s.contains("__private::try_backward(m::__private::mpx_runtime::__private::scaler_of"),
            "{s}"
        );
        assert!(
            s.contains("__mpx_loss,|__mpx_loss|__mpx_loss.try_backward())}?;"),
            "{s}"
        );
        // a forward pass of a field: not checked before the call
        assert!(s.contains("__private::call::Field"), "{s}");
        assert!(
            s.contains("Some((self.opt).update(&mutself.model,__mpx_grads))"),
            "{s}"
        );
    }

    #[test]
    fn argument_errors_are_all_reported() {
        let out = super::expand(
            quote!(half = f64, scale = 1.0, crate = "a", crate = "b"),
            mnist_loop(),
        );
        assert_eq!(
            messages(&out),
            [
                "`half = f64` is not a precision a mixed step runs in; expected one of `f16`, `AMP<f16>`, `bf16`, `f32`",
                "unknown argument `scale`; expected one of `scaling`, `half`, `crate`",
                "duplicate argument `crate`",
                "missing argument `scaling`: name the mixed-precision state, declared once outside the loop, e.g. `#[mixed_step(scaling = scaler)]` with `let mut scaler = mpx::step::GradScaler::default();`",
            ]
        );
        // The item is re-emitted unchanged.
        let kept = items(&out);
        assert_eq!(quote!(#(#kept)*).to_string(), mnist_loop().to_string());
    }

    #[test]
    fn a_scaler_that_would_not_persist_is_an_error() {
        let temp = super::expand(quote!(scaling = &mut GradScaler::default()), mnist_loop());
        assert!(
            messages(&temp)[0]
                .starts_with("`scaling = ..` builds a new value every time the step runs")
        );
        let in_loop = super::expand(
            quote!(scaling = s),
            quote!(
                fn train(model: &mut M, opt: &mut O, data: D) {
                    for (x, y) in data {
                        let mut s = GradScaler::default();
                        let out = model.forward(x.trace(model.alloc_grads()));
                        let g = out.mean().backward();
                        opt.update(model, &g).unwrap();
                    }
                }
            ),
        );
        assert!(
            messages(&in_loop)[0].starts_with("`s` is declared inside a loop or closure"),
            "{:?}",
            messages(&in_loop)
        );
        let per_call = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(model: &mut M, opt: &mut O, x: X) {
                    let mut s = GradScaler::default();
                    let out = model.forward(x.trace(model.alloc_grads()));
                    let g = out.mean().backward();
                    opt.update(model, &g).unwrap();
                }
            ),
        );
        assert!(messages(&per_call)[0].starts_with("`s` is declared inside the step function"));
        let before_loop = super::expand(
            quote!(scaling = s),
            quote!(
                fn train(model: &mut M, opt: &mut O, data: D) {
                    let mut s = GradScaler::default();
                    for x in data {
                        let out = model.forward(x.trace(model.alloc_grads()));
                        let g = out.mean().backward();
                        opt.update(model, &g).unwrap();
                    }
                }
            ),
        );
        assert!(messages(&before_loop).is_empty());
    }

    /// An update or a backward pass inside a macro's arguments is an error at that macro, which
    /// says how to write it; without one, the error names the function.
    #[test]
    fn a_role_inside_a_macro_is_an_error_at_the_macro() {
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(model: &mut M, opt: &mut O, x: X, s: &mut GradScaler) {
                    let g = model
                        .forward(x.trace(model.alloc_grads()))
                        .mean()
                        .backward();
                    println!("{:?}", opt.update(model, &g));
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 1, "{m:#?}");
        assert!(
            m[0].starts_with("this optimizer update is inside a macro's arguments"),
            "{m:#?}"
        );
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(model: &mut M, opt: &mut O, x: X, s: &mut GradScaler) {
                    let out = model.forward(x.trace(model.alloc_grads()));
                    let g = dbg!(out.mean().backward());
                    opt.update(model, &g).unwrap();
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 1, "{m:#?}");
        assert!(
            m[0].starts_with("this backward pass is inside a macro's arguments"),
            "{m:#?}"
        );
        // a macro that merely mentions the names is no role
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn eval(model: &Model, x: X) -> f32 {
                    println!("update {}", x.update);
                    model.forward(x).array()
                }
            ),
        );
        assert!(messages(&out)[0].starts_with("no optimizer update in this step"));
    }

    #[test]
    fn a_step_without_roles() {
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn eval(model: &Model, x: X) -> f32 {
                    let out = model.forward(x);
                    out.array()
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 1, "{m:#?}");
        assert!(m[0].starts_with("no optimizer update in this step"));
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(model: &mut Model, opt: &mut O, x: X) {
                    let out = model.forward(x);
                    opt.update(model, &g).unwrap();
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 2, "{m:#?}");
        assert!(m[0].starts_with("this forward pass of `model` has no traced input"));
        assert!(m[1].starts_with("no backward pass in this step"));
    }

    #[test]
    fn two_masters_each_get_their_roles() {
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(g: &mut G, d: &mut D, og: &mut O, od: &mut O, z: Z) {
                    let fake = g.forward(z.traced(g.alloc_grads()));
                    let grads = d.forward(fake).mean().backward();
                    og.update(g, &grads).unwrap();
                    od.update(d, &grads).unwrap();
                }
            ),
        );
        assert!(messages(&out).is_empty(), "{out}");
        let s = flat(&out);
        // `d`'s forward pass takes `g`'s traced output: it runs on `d`'s working copy
        assert!(
            s.contains("&__mpx_masters,(g).__mpx_master(),__mpx_input,"),
            "{s}"
        );
        assert!(
            s.contains("&__mpx_masters,(d).__mpx_master(),__mpx_input,"),
            "{s}"
        );
        assert!(
            s.contains("&__mpx_masters,(g).__mpx_master_mut(),&__MPX_SITE);"),
            "{s}"
        );
        assert!(
            s.contains("&__mpx_masters,(d).__mpx_master_mut(),&__MPX_SITE);"),
            "{s}"
        );
        // a master without a traced forward pass is reported at the update that names it
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(a: &mut A, b: &mut B, oa: &mut O, ob: &mut O, x: X) {
                    let g = a.forward(x.traced(a.alloc_grads())).mean().backward();
                    oa.update(a, &g).unwrap();
                    ob.update(b, &g).unwrap();
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 1, "{m:#?}");
        assert!(m[0].starts_with("this update names `b`, but no traced forward pass of `b` runs in this step: the traced forward pass runs `a`"), "{m:#?}");
        // a model and a part of it, or a part and a part of that, each with an optimizer: the
        // inner update is reported at its model's tokens, once
        for (outer, inner) in [(quote!(m), quote!(m.dec)), (quote!(m.enc), quote!(m.enc.0))] {
            let out = super::expand(
                quote!(scaling = s),
                quote!(
                    fn step(m: &mut M, oe: &mut O, od: &mut O, x: X) {
                        let g = m.forward(x.traced(m.alloc_grads())).mean().backward();
                        oe.update(&mut #outer, &g).unwrap();
                        od.update(&mut #inner, &g).unwrap();
                    }
                ),
            );
            let m = messages(&out);
            assert_eq!(m.len(), 1, "{m:#?}");
            let (outer, inner) = (flat(&outer), flat(&inner));
            assert!(
                m[0].starts_with(&format!(
                    "this update names `{inner}`, a part of `{outer}`, which this step also updates"
                )),
                "{m:#?}"
            );
        }
        // an optimizer for each part of a model whose forward pass runs as a whole: the forward
        // pass hands each part's cell to the scaler
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(m: &mut M, oe: &mut O, od: &mut O, x: X) {
                    let g = m.forward(x.traced(m.alloc_grads())).mean().backward();
                    oe.update(&mut m.enc, &g).unwrap();
                    od.update(&mut m.dec, &g).unwrap();
                }
            ),
        );
        assert!(messages(&out).is_empty(), "{out}");
        let s = flat(&out);
        assert!(
            s.contains("let__mpx_parts=::std::vec![::mpx::__private::mpx_runtime::__private::part(&__mpx_masters,(m.enc).__mpx_master()),::mpx::__private::mpx_runtime::__private::part(&__mpx_masters,(m.dec).__mpx_master())];"),
            "{s}"
        );
        assert!(
            s.contains(",(m).__mpx_master(),__mpx_input,).parts(__mpx_parts))"),
            "{s}"
        );
        // a forward pass inside a helper function: the message says the body is all it reads
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn step(a: &mut A, oa: &mut O, x: X, y: Y) {
                    let g = loss_of(a, x.traced(a.alloc_grads()), y).backward();
                    oa.update(a, &g).unwrap();
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 1, "{m:#?}");
        assert!(m[0].ends_with("a forward pass inside a helper function is not seen: call `a.forward(..)` here and pass its output to the helper"), "{m:#?}");
    }

    #[test]
    fn a_local_scaler_without_a_type_gets_the_default_one() {
        let out = super::expand(
            quote!(scaling = scaler),
            quote!(
                fn train(model: &mut M, opt: &mut O, data: D) {
                    let mut scaler = GradScaler::default();
                    for x in data {
                        let g = model
                            .forward(x.trace(model.alloc_grads()))
                            .mean()
                            .backward();
                        opt.update(model, &g).unwrap();
                    }
                }
            ),
        );
        assert!(messages(&out).is_empty(), "{out}");
        let s = flat(&out);
        assert!(
            s.contains("letmutscaler:::mpx::__private::mpx_runtime::step::GradScaler<::mpx::__private::mpx_runtime::precision::f16>=GradScaler::default();"),
            "{s}"
        );
    }

    #[test]
    fn not_a_function() {
        let out = super::expand(quote!(scaling = s), quote!(impl Foo for Bar {}));
        assert_eq!(messages(&out).len(), 1);
        assert!(messages(&out)[0].starts_with("`#[mixed_step]` applies to a function that trains"));
    }
}
