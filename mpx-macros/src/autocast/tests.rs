//! Expansion tests of `#[autocast]`: what is wrapped, what is left, and every error.

#![allow(
    clippy::needless_pass_by_value,
    reason = "the helpers take the token streams `quote!` builds, as the macros' entry points do"
)]

use proc_macro2::TokenStream;
use quote::quote;

use crate::ctxt::testing::{items, messages};

const RUN: &str = ":: mpx :: __private :: mpx_runtime :: region :: FullPrecision :: < H > :: run";

/// Expands `body` inside `fn f<H: Precision, T: Tape<H::Elem, Cpu>>(..) -> X`, with no error.
fn body(args: TokenStream, body: TokenStream) -> String {
    let out = super::expand(
        args,
        quote!(
            fn f<H: Precision, T: Tape<H::Elem, Cpu>>(x: X<H::Elem, T>, y: X<H::Elem>) -> X<H::Elem, T> {
                #body
            }
        ),
    );
    assert!(messages(&out).is_empty(), "{out}");
    out.to_string()
}

#[test]
fn a_method_call_becomes_a_region_and_the_rest_is_untouched() {
    let s = body(quote!(), quote!(x.matmul(w).softmax::<Axis<1>>().matmul(v)));
    assert!(
        s.contains(&format!(
            "{{ {RUN} (x . matmul (w) , | __mpx_x0 | __mpx_x0 . softmax :: < Axis < 1 > > ()) . matmul (v) }}"
        )),
        "{s}"
    );
    assert_eq!(s.matches("FullPrecision").count(), 1, "{s}");
}

#[test]
fn a_chain_of_operations_is_one_region_and_scalars_stay_inside() {
    let s = body(
        quote!(),
        quote!(
            (x * 2.0)
                .exp()
                .sum::<_, Axis<1>>()
                .normalize::<Axis<0>>(self.eps)
        ),
    );
    assert!(
        s.contains(&format!(
            "{RUN} (x * 2.0 , | __mpx_x0 | __mpx_x0 . exp () . sum :: < _ , Axis < 1 > > () . normalize :: < Axis < 0 > > (self . eps))"
        )),
        "{s}"
    );
    // the input is an argument without the parentheses it needed as a receiver (kept, they
    // warned as unused in the user's crate)
    assert!(!s.contains("((x * 2.0)"), "{s}");
    assert_eq!(s.matches("FullPrecision").count(), 1, "{s}");
}

#[test]
fn operations_in_an_input_get_their_own_region() {
    // The product is not an operation of the table: it stays in the half type, between two
    // regions.
    let s = body(quote!(), quote!((x.softmax::<Axis<1>>() * y).sum()));
    assert!(
        s.contains(&format!(
            "{RUN} ({RUN} (x , | __mpx_x0 | __mpx_x0 . softmax :: < Axis < 1 > > ()) * y , | __mpx_x0 | __mpx_x0 . sum ())"
        )),
        "{s}"
    );
}

#[test]
fn a_loss_takes_prediction_and_target_as_a_tuple() {
    let s = body(
        quote!(),
        quote!({
            let a = dfdx::losses::huber_loss(x.clone(), y.clone(), self.delta);
            mse_loss(x.exp(), y)
        }),
    );
    assert!(
        s.contains(&format!(
            "let a = {RUN} ((x . clone () , y . clone () ,) , | (__mpx_x0 , __mpx_x1 ,) | dfdx :: losses :: huber_loss (__mpx_x0 , __mpx_x1 . retaped () , self . delta))"
        )),
        "{s}"
    );
    // The prediction's chain joins the loss's region.
    assert!(
        s.contains(&format!(
            "{RUN} ((x , y ,) , | (__mpx_x0 , __mpx_x1 ,) | mse_loss (__mpx_x0 . exp () , __mpx_x1 . retaped ()))"
        )),
        "{s}"
    );
}

#[test]
fn try_forms_become_try_run_and_absorb_their_question_marks() {
    let s = body(quote!(), quote!(Ok(x.try_exp()?.try_sum::<_, Axis<1>>()?)));
    let try_run = RUN.replace(":: run", ":: try_run");
    assert!(
        s.contains(&format!(
            "Ok ({try_run} (x , | __mpx_x0 | __mpx_x0 . exp () . sum :: < _ , Axis < 1 > > ()) ?)"
        )),
        "{s}"
    );
}

#[test]
fn calls_that_cannot_be_tensor_operations_are_left() {
    let kept = [
        quote!(v.iter().map(|a| a * a).sum::<f32>()),
        quote!(v.iter().sum()),
        quote!(2.0f32.exp()),
        quote!((0..n).sum()),
        quote!([1.0, 2.0].sum()),
        quote!(self.sum()),
        quote!((&x).exp()),
        quote!((k as f32).ln()),
        quote!(f32::exp(k)),
        quote!(Self::ln(k)),
        quote!(x.softmax(1)),
        quote!(self.norm.normalize(x, 1e-5)),
        quote!(self.ln.normalize(x)),
        quote!(mse_loss(x)),
        quote!(<L as Loss>::mse_loss(x, y)),
        quote!(vec![x.exp()]),
    ];
    for e in kept {
        // One wrapped call keeps the function valid; `e` itself must come out unchanged.
        let s = body(quote!(), quote!({ let k = #e; x.exp() }));
        assert!(s.contains(&format!("let k = {e} ;")), "{e}: {s}");
        assert_eq!(s.matches("FullPrecision").count(), 1, "{e}: {s}");
    }
}

#[test]
fn skip_keeps_named_operations_in_the_half_type() {
    let s = body(quote!(skip = (sum, mean)), quote!(x.exp().sum() + y.mean()));
    assert!(
        s.contains(&format!(
            "{RUN} (x , | __mpx_x0 | __mpx_x0 . exp ()) . sum () + y . mean ()"
        )),
        "{s}"
    );
}

#[test]
fn half_type_from_the_arguments_and_the_crate_path() {
    let out = super::expand(
        quote!(half = AMP<f16>, crate = "my_mpx"),
        quote!(
            fn try_forward(
                &self,
                x: Tensor<S, AMP<f16>, Cpu, T>,
            ) -> Result<Self::Output, Self::Error> {
                Ok(self.attn.forward(x).try_softmax::<Axis<1>>()?)
            }
        ),
    );
    assert!(messages(&out).is_empty(), "{out}");
    let s = out.to_string();
    assert!(
        s.contains("my_mpx :: __private :: mpx_runtime :: region :: FullPrecision :: < AMP < f16 > > :: try_run (self . attn . forward (x) , | __mpx_x0 | __mpx_x0 . softmax :: < Axis < 1 > > ()) ?"),
        "{s}"
    );
    // The signature is kept as written.
    assert!(s.contains("fn try_forward (& self , x : Tensor < S , AMP < f16 > , Cpu , T > ,) -> Result < Self :: Output , Self :: Error >"), "{s}");
}

#[test]
fn closures_are_rewritten_and_nested_items_are_not() {
    let s = body(
        quote!(),
        quote!({
            fn helper(x: X) -> X {
                x.exp()
            }
            let g = |t: X| t.ln();
            g(x)
        }),
    );
    assert!(s.contains("fn helper (x : X) -> X { x . exp () }"), "{s}");
    assert!(
        s.contains(&format!(
            "| t : X | {RUN} (t , | __mpx_x0 | __mpx_x0 . ln ())"
        )),
        "{s}"
    );
}

#[test]
fn not_a_function_is_an_error_and_the_item_is_kept() {
    let item = quote!(
        struct Attention {
            heads: usize,
        }
    );
    let out = super::expand(quote!(), item.clone());
    let m = messages(&out);
    assert_eq!(m.len(), 1, "{m:#?}");
    assert!(m[0].starts_with("`#[autocast]` applies to a function or a method with a body"));
    let kept = items(&out);
    assert_eq!(quote!(#(#kept)*).to_string(), item.to_string());
}

#[test]
fn no_tensor_operation_and_no_half_type_are_errors() {
    let out = super::expand(
        quote!(),
        quote!(
            fn total(v: &[f32], n: usize) -> f32 {
                v.iter().sum::<f32>() / (0..n).sum::<usize>() as f32
            }
        ),
    );
    let m = messages(&out);
    assert_eq!(m.len(), 2, "{m:#?}");
    assert!(
        m[0].starts_with("`#[autocast]` cannot tell the half type"),
        "{}",
        m[0]
    );
    assert!(
        m[1].starts_with("`#[autocast]` found no tensor operation to run in f32"),
        "{}",
        m[1]
    );
    assert!(
        m[1].contains("`softmax`") && m[1].contains("`mse_loss`"),
        "{}",
        m[1]
    );
}

#[test]
fn every_error_is_reported_at_once_and_the_item_is_kept() {
    let item = quote!(
        const fn f<H: Precision>(x: X) -> X {
            x.powf(scale()?).normalize::<Axis<1>>(return x)
        }
    );
    let out = super::expand(
        quote!(scale = 2, half = H, half = f16, skip = (sum, relu, sum)),
        item.clone(),
    );
    let m = messages(&out);
    let expect = [
        "unknown argument `scale`; expected one of `half`, `skip`, `crate`",
        "duplicate argument `half`",
        "`#[autocast]` cannot rewrite a `const fn`",
        "`skip` names `relu`, which `#[autocast]` does not wrap; it wraps `cross_entropy_with_logits_loss`",
        "`sum` is listed twice in `skip`",
        "the arguments of `powf` into the closure of an f32 region, where `?` cannot leave",
        "the arguments of `normalize` into the closure of an f32 region, where `return` cannot leave",
    ];
    assert_eq!(m.len(), expect.len(), "{m:#?}");
    for (got, want) in m.iter().zip(expect) {
        assert!(got.contains(want), "{got} / {want}");
    }
    let kept = items(&out);
    let squeeze = |s: String| s.replace(' ', "");
    assert_eq!(
        squeeze(quote!(#(#kept)*).to_string()),
        squeeze(item.to_string())
    );
}

#[test]
fn loops_and_closures_in_a_scalar_argument_are_their_own() {
    let s = body(
        quote!(),
        quote!(
            x.powf(loop {
                break 2.0;
            })
            .powi((|| -> Option<i32> { Some(k?) })().unwrap_or(2))
        ),
    );
    assert_eq!(s.matches("FullPrecision").count(), 1, "{s}");
}

#[test]
fn arguments_must_be_well_formed() {
    let out = super::expand(
        quote!(skip = 3, crate = mpx),
        quote!(
            fn f<H: Precision>(x: X) -> X {
                x.exp()
            }
        ),
    );
    let m = messages(&out);
    assert_eq!(m.len(), 1, "{m:#?}");
    assert!(m[0].contains("`skip` lists operation names"), "{}", m[0]);
}

#[test]
fn free_functions_become_the_methods_they_stand_for() {
    let s = body(
        quote!(),
        quote!({
            let a = ln(x.sum());
            let b = softmax::<Axis<1>, _, _, _, _>(y + z);
            let c = ln(1.5f32, 2.0);
        }),
    );
    assert!(
        s.contains("run (x , | __mpx_x0 | __mpx_x0 . sum () . ln ())"),
        "{s}"
    );
    assert!(
        s.contains("run (y + z , | __mpx_x0 | __mpx_x0 . softmax :: < Axis < 1 > > ())"),
        "{s}"
    );
    // another function of the same name, with another argument count, stays
    assert!(s.contains("ln (1.5f32 , 2.0)"), "{s}");
}
