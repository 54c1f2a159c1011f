//! `#[mixed_step]`: parse ([`ast`]) -> validate ([`valid`], which also reads the step's shape)
//! -> expand ([`expand`]).

mod ast;
mod expand;
mod valid;

use proc_macro2::TokenStream;

use crate::ctxt::{Ctxt, with_errors};
use crate::full_precision::item_head;

/// Entry point: the rewritten step, or the errors followed by the user's item unchanged.
pub fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut cx = Ctxt::default();
    let parsed_args = ast::parse_args(args, &mut cx);
    let f = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Fn(f)) => Some(f),
        Ok(other) => {
            cx.error_spanned(
                item_head(&other),
                "`#[mixed_step]` applies to a training-step function (alloc_grads, traced forward, loss, backward, optimizer update)",
            );
            None
        }
        Err(err) => {
            cx.push(syn::Error::new(
                err.span(),
                format!("`#[mixed_step]` applies to a training-step function ({err})"),
            ));
            None
        }
    };
    let plan = f
        .as_ref()
        .and_then(|f| valid::check(&parsed_args, f, &mut cx));
    match (cx.check(), f, plan) {
        (Ok(()), Some(f), Some(plan)) => expand::expand(&parsed_args, plan, f),
        (Err(err), _, _) => with_errors(item, err),
        _ => with_errors(
            item,
            syn::Error::new(
                proc_macro2::Span::call_site(),
                "`#[mixed_step]` could not rewrite this item",
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use crate::ctxt::testing::{items, messages};
    use proc_macro2::TokenStream;
    use quote::quote;

    fn step_body() -> TokenStream {
        quote!(
            fn train_step(
                model: &mut Model,
                opt: &mut Adam<Model, f32, Cpu>,
                x: X,
                y: Y,
                scaler: &mut DynamicLossScale,
            ) -> f32 {
                let grads = model.alloc_grads();
                let logits = model.forward_mut(x.traced(grads));
                let loss = cross_entropy_with_logits_loss(logits, y);
                let loss_value = loss.array();
                let grads = loss.backward();
                opt.update(model, &grads).expect("update");
                loss_value
            }
        )
    }

    #[test]
    fn rewrites_an_f32_step() {
        let out = super::expand(quote!(scaling = scaler, half = f16), step_body());
        assert!(messages(&out).is_empty(), "{out}");
        let s = out.to_string();
        for want in [
            "-> :: core :: result :: Result < :: mpx :: __private :: mpx_runtime :: boundary :: StepReport , :: mpx :: __private :: mpx_runtime :: step :: StepError >",
            "let __mpx_input = x ;",
            ":: mpx :: __private :: mpx_runtime :: step :: MixedWorkspace :: < :: mpx :: __private :: mpx_runtime :: precision :: f16 , _ > :: new (& * (model)) ?",
            "__mpx_model . forward_mut (:: mpx :: __private :: mpx_runtime :: boundary :: cast_input :: < :: mpx :: __private :: mpx_runtime :: precision :: f16 , _ > (& __mpx_input , __mpx_tape))",
            "| logits | { let loss = cross_entropy_with_logits_loss (logits , y) ; let loss_value = loss . array () ; let _ = & loss_value ; loss }",
            "optimizer_update (model , opt , & __mpx_grads , __mpx_finite) ?",
            ":: core :: result :: Result :: Ok (__mpx_report)",
        ] {
            assert!(s.contains(want), "missing {want}\nin {s}");
        }
        assert!(!s.contains("alloc_grads"), "{s}");
        assert!(!s.contains("expect"), "{s}");
    }

    #[test]
    fn half_types_workspace_and_crate() {
        let out = super::expand(
            quote!(
                scaling = &mut self.scale,
                half = amp_f16,
                workspace = ws,
                crate = "m"
            ),
            step_body(),
        );
        let s = out.to_string();
        assert!(s.contains("m :: __private :: mpx_runtime :: precision :: AMP < m :: __private :: mpx_runtime :: precision :: f16 >"), "{s}");
        assert!(s.contains("let __mpx_ws = ws ;"), "{s}");
        assert!(
            s.contains("filter_value_and_grad (& * (model) , & mut self . scale ,"),
            "{s}"
        );
        let out = super::expand(quote!(scaling = s, half = bf16), step_body());
        assert!(out.to_string().contains("precision :: bf16"));
    }

    #[test]
    fn argument_errors_are_all_reported() {
        let out = super::expand(
            quote!(half = f32, scale = 1.0, workspace = a, workspace = b),
            step_body(),
        );
        assert_eq!(
            messages(&out),
            [
                "`half = f32` is not a half type (f32 is the master's precision, not a half type); expected one of `f16`, `amp_f16`, `bf16`",
                "unknown argument `scale`; expected one of `scaling`, `half`, `workspace`, `crate`",
                "duplicate argument `workspace`",
                "missing argument `scaling`: pass the loss scale, e.g. `#[mixed_step(scaling = scaler)]` with `scaler: &mut DynamicLossScale` (use `NoOpLossScale` for none)",
            ]
        );
        // The step is re-emitted unchanged.
        let kept = items(&out);
        assert_eq!(quote!(#(#kept)*).to_string(), step_body().to_string());
    }

    #[test]
    fn a_step_without_backward_update_or_forward() {
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
        assert_eq!(m.len(), 3, "{m:#?}");
        assert!(m[0].starts_with("no traced forward pass"));
        assert!(m[1].starts_with("no loss to scale"));
        assert!(m[2].starts_with("no optimizer update"));
    }

    #[test]
    fn step_endings_replaced_by_the_report() {
        let step = |ret: TokenStream, last: TokenStream| {
            let out = super::expand(
                quote!(scaling = s),
                quote!(
                    fn f(model: &mut M, opt: &mut O, x: X) #ret {
                        let out = model.forward(x.traced(g));
                        let loss = out.mean();
                        let value = loss.array();
                        let grads = loss.backward();
                        opt.update(model, &grads)?;
                        #last
                    }
                ),
            );
            (messages(&out), out.to_string())
        };
        // Accepted: the loss binding, and `Ok(())` / `Ok(loss)` in a step that returned a Result.
        for (ret, last) in [
            (quote!(-> f32), quote!(value)),
            (quote!(-> Result<(), E>), quote!(Ok(()))),
            (quote!(-> Result<f32, E>), quote!(Ok(value))),
        ] {
            let (m, s) = step(ret, last);
            assert!(m.is_empty(), "{m:?}");
            assert!(
                s.contains(":: core :: result :: Result :: Ok (__mpx_report)"),
                "{s}"
            );
            assert!(!s.contains("Ok (())") && !s.contains("Ok (value)"), "{s}");
        }
        // Rejected: `Ok(())` where no Result was declared, `Ok` of something else.
        for (ret, last) in [
            (quote!(), quote!(Ok(()))),
            (quote!(-> Result<usize, E>), quote!(Ok(1))),
        ] {
            let (m, _) = step(ret, last);
            assert_eq!(m.len(), 1, "{m:?}");
            assert!(m[0].starts_with("a `#[mixed_step]` function returns its `StepReport`"));
        }
    }

    #[test]
    fn shape_errors() {
        // Update before backward.
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn f(model: &mut M, opt: &mut O, x: X) {
                    let out = model.forward(x.traced(g));
                    opt.update(model, &grads).unwrap();
                    let grads = out.backward();
                }
            ),
        );
        assert_eq!(
            messages(&out),
            [
                "the step must run forward pass, then `loss.backward()`, then `opt.update(..)`, in that order"
            ]
        );
        // Another model updated, code between backward and update, a trailing value.
        let out = super::expand(
            quote!(scaling = s),
            quote!(
                fn f(model: &mut M, other: &mut M, opt: &mut O, x: X) -> usize {
                    let out = model.forward(x.traced(g));
                    let loss = out.mean();
                    let grads = loss.backward();
                    clip(&grads);
                    opt.update(other, &grads).unwrap();
                    42
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 4, "{m:#?}");
        assert!(m[0].starts_with("the optimizer updates `other` but the forward pass ran `model`"));
        assert!(m[1].starts_with("statements between `backward()` and the optimizer update"));
        assert!(m[2].starts_with("a `#[mixed_step]` function returns its `StepReport`"));
        assert!(
            m[3].starts_with("a `#[mixed_step]` function returns `Result<StepReport, StepError>`")
        );
    }

    #[test]
    fn not_a_function() {
        let out = super::expand(quote!(scaling = s), quote!(impl Foo for Bar {}));
        assert_eq!(messages(&out).len(), 1);
        assert!(
            messages(&out)[0].starts_with("`#[mixed_step]` applies to a training-step function")
        );
    }
}
