//! `#[full_precision]`: parse ([`ast`]) -> validate ([`valid`]) -> expand ([`expand`]).
//!
//! ```text
//! #[full_precision]
//! fn layer_norm<H: Precision>(x: Tensor<S, H::Elem, Cpu, T>) -> Tensor<S, H::Elem, Cpu, T> { body }
//! // becomes
//! fn layer_norm<H: Precision>(__mpx_x0: Tensor<S, H::Elem, Cpu, T>) -> Tensor<S, H::Elem, Cpu, T> {
//!     ::mpx::__private::mpx_runtime::region::FullPrecision::<H>::run(__mpx_x0, |x| { body })
//! }
//! ```

mod ast;
mod expand;
mod valid;

use proc_macro2::TokenStream;

use crate::ctxt::expand_fn;

/// Entry point: the expanded function, or the errors followed by the user's item unchanged.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    expand_fn(
        ("full_precision", "a function or a method with a body"),
        (args, item),
        ast::parse_args,
        |args, f, cx| {
            let f = f?;
            Some((valid::check(args, &f, cx)?, f))
        },
        |args, (plan, f)| expand::expand(args, &plan, f),
    )
}

#[cfg(test)]
mod tests {
    use crate::ctxt::testing::{items, messages};
    use quote::quote;

    fn run(
        args: proc_macro2::TokenStream,
        item: proc_macro2::TokenStream,
    ) -> proc_macro2::TokenStream {
        super::expand(args, item)
    }

    #[test]
    fn rewrites_the_body_into_a_region() {
        let out = run(
            quote!(),
            quote!(
                fn ln<H: Precision, T>(
                    x: Tensor<S, H::Elem, Cpu, T>,
                ) -> Tensor<S, H::Elem, Cpu, T> {
                    x.exp()
                }
            ),
        );
        assert!(messages(&out).is_empty());
        let s = out.to_string();
        assert!(s.contains(":: mpx :: __private :: mpx_runtime :: region :: FullPrecision :: < H > :: run (__mpx_x0 , | x | { x . exp () })"), "{s}");
        assert!(
            s.contains("fn ln < H : Precision , T > (__mpx_x0 : Tensor"),
            "{s}"
        );
    }

    #[test]
    fn several_arguments_become_a_tuple_and_params_a_field_copy() {
        let out = run(
            quote!(half = H, params = self.ln, crate = "my_mpx"),
            quote!(
                fn f(
                    &self,
                    a: Tensor<S, E, Cpu, T>,
                    (b, c): (Tensor<S, E, Cpu>, Tensor<S, E, Cpu>),
                    k: f32,
                ) -> Tensor<S, E, Cpu, T> {
                    self.ln.forward(a * b * c * k)
                }
            ),
        );
        assert!(messages(&out).is_empty());
        let s = out.to_string();
        assert!(s.contains("my_mpx :: __private :: mpx_runtime :: region :: FullPrecision :: < H > :: run_with (& self . ln , (__mpx_x0 , __mpx_x1 ,) , | __mpx_params , (a , (b , c) ,) |"), "{s}");
        assert!(s.contains("(* __mpx_params) . forward"), "{s}");
        assert!(!s.contains("self . ln . forward"), "{s}");
    }

    #[test]
    fn params_argument_shadows_the_module() {
        let out = run(
            quote!(params = ln),
            quote!(
                fn f<H: HalfPrecision>(
                    ln: &Ln<H::Elem>,
                    x: Tensor<S, H::Elem, Cpu, T>,
                ) -> Tensor<S, H::Elem, Cpu, T> {
                    ln.forward(x)
                }
            ),
        );
        assert!(messages(&out).is_empty());
        assert!(
            out.to_string()
                .contains("run_with (ln , __mpx_x0 , | ln , x |"),
            "{out}"
        );
    }

    #[test]
    fn not_a_function_is_an_error_and_the_item_is_kept() {
        let item = quote!(
            struct S {
                x: u32,
            }
        );
        let out = run(quote!(), item.clone());
        assert_eq!(
            messages(&out),
            ["`#[full_precision]` applies to a function or a method with a body"]
        );
        let kept = items(&out);
        assert_eq!(quote!(#(#kept)*).to_string(), item.to_string());
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let out = run(
            quote!(scale = 2, half = H, half = f16, crate = "a"),
            quote!(
                const async extern "C" fn f(x: &Tensor<S, f16, Cpu>) {}
            ),
        );
        let m = messages(&out);
        let expect = [
            "unknown argument `scale`; expected one of `half`, `params`, `inputs`, `crate`",
            "duplicate argument `half`",
            "`#[full_precision]` cannot rewrite a `const fn`",
            "cannot rewrite an `async fn`",
            "cannot rewrite an `extern` function",
            "takes tensors by value",
            "functions return one tensor: add",
        ];
        assert_eq!(m.len(), expect.len(), "{m:#?}");
        for (got, want) in m.iter().zip(expect) {
            assert!(got.contains(want), "{got} / {want}");
        }
        // The function is re-emitted unchanged.
        assert!(
            out.to_string()
                .contains("const async extern \"C\" fn f (x : & Tensor < S , f16 , Cpu >) { }")
        );
    }

    #[test]
    fn no_tensor_and_no_half_type_are_errors() {
        let out = run(
            quote!(),
            quote!(
                fn f(n: usize) -> Tensor<S, f32, Cpu> {
                    todo()
                }
            ),
        );
        let m = messages(&out);
        assert_eq!(m.len(), 2, "{m:#?}");
        assert!(m[0].contains("found no tensor to cast"));
        assert!(m[1].contains("cannot tell the half type"));
    }

    #[test]
    fn inputs_names_aliased_tensors() {
        let out = run(
            quote!(inputs = (x, y), half = f16),
            quote!(
                fn f(x: X, y: X, z: usize) -> X {
                    x + y
                }
            ),
        );
        assert!(messages(&out).is_empty(), "{out}");
        assert!(
            out.to_string()
                .contains("run ((__mpx_x0 , __mpx_x1 ,) , | (x , y ,) |")
        );
        let out = run(
            quote!(inputs = (x, w)),
            quote!(
                fn f<H: Precision>(x: X) -> X {
                    x
                }
            ),
        );
        assert_eq!(
            messages(&out),
            ["`inputs` names `w`, which is not an argument of this function"]
        );
    }
}
