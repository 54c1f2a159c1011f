//! Expansion: the step becomes `filter_value_and_grad` (forward on the half working copy, loss
//! and its scaling in f32) followed by `optimizer_update` (skip on overflow), returning a
//! `StepReport`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::ast::{Args, Half};
use super::valid::Plan;
use crate::ctxt::runtime_path;

/// Rewrites the step according to `plan`.
pub(crate) fn expand(args: &Args, plan: Plan, mut f: syn::ItemFn) -> TokenStream {
    let root = runtime_path(args.krate.as_ref());
    let half = match plan.half {
        Half::F16 => quote!(#root::precision::f16),
        Half::AmpF16 => quote!(#root::precision::AMP<#root::precision::f16>),
        Half::Bf16 => quote!(#root::precision::bf16),
    };
    let step = plan.step;
    let scaling = &plan.scaling;
    let master = &step.master;
    let forward = &step.forward;
    let input = &step.input;
    let out_pat = &step.out_pat;
    let loss = &step.loss;
    let prefix = &step.prefix;
    let loss_stmts = &step.loss_stmts;
    let tail = &step.tail;
    // The binding the step returned is read by the report instead; keep it "used".
    let replaced = step.replaced.as_ref().map(|id| quote!(let _ = &#id;));

    // The optimizer as `&mut O`: a reference argument is passed as it is, anything else borrowed.
    let opt = &step.opt;
    let opt_is_ref_arg = match opt {
        syn::Expr::Path(p) => p.path.get_ident().is_some_and(|id| {
            f.sig.inputs.iter().any(|a| {
                matches!(a, syn::FnArg::Typed(pt)
                if matches!(&*pt.pat, syn::Pat::Ident(pi) if pi.ident == *id)
                    && matches!(&*pt.ty, syn::Type::Reference(_)))
            })
        }),
        _ => false,
    };
    let opt = if opt_is_ref_arg {
        quote!(#opt)
    } else {
        quote!(&mut (#opt))
    };

    let workspace = match &args.workspace {
        Some(ws) => quote!(let __mpx_ws = #ws;),
        None => quote! {
            let mut __mpx_ws_owned = #root::step::MixedWorkspace::<#half, _>::new(&*(#master))?;
            let __mpx_ws = &mut __mpx_ws_owned;
        },
    };

    // The master boundary first, at the model's tokens, so its message leads the errors.
    let check_master = quote_spanned!(master.span()=>
        let _ = #root::boundary::require_master(&*(#master));
    );
    // The input boundary at the input's tokens: a half batch is reported where it is named.
    let cast_input = quote_spanned!(input.span()=>
        #root::boundary::cast_input::<#half, _>(&__mpx_input, __mpx_tape)
    );
    let body = quote!({
        #check_master
        #(#prefix)*
        let __mpx_input = #input;
        #workspace
        let __mpx_grads = #root::step::filter_value_and_grad(
            &*(#master),
            #scaling,
            &mut *__mpx_ws,
            |__mpx_model, __mpx_tape| {
                __mpx_model.#forward(#cast_input)
            },
            |#out_pat| {
                #(#loss_stmts)*
                #replaced
                #loss
            },
        )?;
        let __mpx_finite = __mpx_grads.grads_finite;
        let __mpx_outcome = #root::step::optimizer_update(#master, #opt, &__mpx_grads, __mpx_finite)?;
        let __mpx_report = #root::boundary::StepReport {
            loss: __mpx_grads.loss,
            grads_finite: __mpx_finite,
            scale: __mpx_grads.applied_scale,
            new_scale: __mpx_grads.new_scale,
            outcome: __mpx_outcome,
        };
        #(#tail)*
        ::core::result::Result::Ok(__mpx_report)
    });
    f.sig.output = syn::parse_quote!(
        -> ::core::result::Result<#root::boundary::StepReport, #root::step::StepError>
    );
    *f.block = syn::parse_quote!(#body);
    quote!(#f)
}
