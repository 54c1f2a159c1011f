//! Expansion tests with `proc_macro2`: what the derive generates, and every error it reports.

#![allow(
    clippy::needless_pass_by_value,
    reason = "the helpers take the token streams `quote!` builds, as the macros' entry points do"
)]

use quote::quote;

use super::expand;

fn norm(ts: proc_macro2::TokenStream) -> String {
    ts.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn errors(ts: proc_macro2::TokenStream) -> Vec<String> {
    let s = ts.to_string();
    s.split("compile_error !")
        .skip(1)
        .map(|part| {
            let start = part.find('"').unwrap_or(0) + 1;
            let end = part[start..].find('"').map_or(part.len(), |e| start + e);
            part[start..end].to_string()
        })
        .collect()
}

#[test]
fn single_type_parameter_is_the_dtype() {
    let out = norm(expand(quote! {
        struct Batch<E: Dtype> {
            x: Tensor<Rank1<4>, E, Cpu>,
            y: Tensor<Rank1<4>, usize, Cpu>,
            #[cast(skip)]
            name: String,
        }
    }));
    assert!(out.contains("impl < E : Dtype , __P : :: mpx :: __private :: mpx_runtime :: precision :: Precision > :: mpx :: __private :: mpx_runtime :: cast :: Cast < __P > for Batch < E >"), "{out}");
    assert!(out.contains("type Output = Batch < < __P as :: mpx :: __private :: mpx_runtime :: precision :: Precision > :: Elem > ;"), "{out}");
    // the dtype's own bounds are required of the output element
    assert!(out.contains("< __P as :: mpx :: __private :: mpx_runtime :: precision :: Precision > :: Elem : Dtype"), "{out}");
    assert!(out.contains("Tensor < Rank1 < 4 > , E , Cpu > : :: mpx :: __private :: mpx_runtime :: cast :: Cast < __P , Output = Tensor < Rank1 < 4 > , < __P as :: mpx :: __private :: mpx_runtime :: precision :: Precision > :: Elem , Cpu > >"), "{out}");
    // integer tensors cast to themselves
    assert!(out.contains("Tensor < Rank1 < 4 > , usize , Cpu > : :: mpx :: __private :: mpx_runtime :: cast :: Cast < __P , Output = Tensor < Rank1 < 4 > , usize , Cpu > >"), "{out}");
    // skipped field: cloned, not bounded, not visited
    assert!(
        out.contains("name : :: core :: clone :: Clone :: clone (& self . name)"),
        "{out}"
    );
    assert!(!out.contains("String : :: mpx"), "{out}");
    assert!(!out.contains("visit_floats (& self . name"), "{out}");
    assert!(out.contains("visit_floats (& self . x , visit)"), "{out}");
}

#[test]
fn dtype_attribute_picks_one_of_several_and_bounds_follow() {
    let out = norm(expand(quote! {
        #[cast(dtype = E, crate = "my_mpx")]
        struct Model<'a, E: Dtype, D: Storage<E>, const N: usize> where D: Clone {
            w: Tensor<Rank1<N>, E, D>,
            r: &'a str,
        }
    }));
    assert!(out.contains("my_mpx :: __private :: mpx_runtime :: cast :: Cast < __P > for Model < 'a , E , D , N >"), "{out}");
    assert!(out.contains("type Output = Model < 'a , < __P as my_mpx :: __private :: mpx_runtime :: precision :: Precision > :: Elem , D , N >"), "{out}");
    assert!(out.contains("D : Storage < < __P as my_mpx :: __private :: mpx_runtime :: precision :: Precision > :: Elem >"), "{out}");
    assert!(out.contains("where D : Clone"), "{out}");
}

#[test]
fn no_type_parameter_casts_to_itself_and_tuple_structs_work() {
    let out = norm(expand(quote! {
        struct Pair(Tensor<Rank1<2>, f32, Cpu>, #[cast(skip)] u8);
    }));
    assert!(out.contains("type Output = Pair ;"), "{out}");
    assert!(out.contains("Pair { 0 : :: mpx :: __private :: mpx_runtime :: cast :: Cast :: < __P > :: cast (& self . 0) , 1 : :: core :: clone :: Clone :: clone (& self . 1) , }"), "{out}");
    assert!(
        out.contains("Output = Tensor < Rank1 < 2 > , f32 , Cpu >"),
        "{out}"
    );
}

#[test]
fn every_error_is_reported_together() {
    let errs = errors(expand(quote! {
        #[cast(dtype = F, scale = 2, crate = "a", crate = "b")]
        struct S<E> {
            #[cast(skip, skip, frozen)]
            x: Vec<E>,
        }
    }));
    let want = [
        "unknown argument `scale`; expected one of `dtype`, `crate`",
        "duplicate argument `crate`",
        "duplicate argument `skip`",
        "unknown field argument `frozen`; expected `skip`",
        "`F` is not a type parameter of `S`; expected one of `E`",
    ];
    for w in want {
        assert!(errs.iter().any(|e| e == w), "missing {w:?} in {errs:#?}");
    }
}

#[test]
fn skipped_field_mentioning_dtype_is_an_error() {
    let errs = errors(expand(quote! {
        struct S<E> { #[cast(skip)] x: Vec<E>, y: E }
    }));
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].starts_with(
            "field `x` is marked `#[cast(skip)]` but its type mentions the dtype parameter `E`"
        ),
        "{errs:?}"
    );
}

#[test]
fn several_type_parameters_need_the_attribute() {
    let errs = errors(expand(
        quote! { struct S<E, D> { x: Tensor<Rank1<2>, E, D> } },
    ));
    assert_eq!(
        errs,
        [
            "`S` has several type parameters (`E`, `D`); name the dtype one with `#[cast(dtype = ...)]`"
        ]
    );
}

#[test]
fn enums_and_unions_are_rejected_with_a_reason() {
    let e = errors(expand(quote! { enum A { X(f32) } }));
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("#[derive(Cast)] supports structs only"),
        "{e:?}"
    );
    let u = errors(expand(quote! { union U { a: f32, b: u32 } }));
    assert!(
        u[0].starts_with("#[derive(Cast)] cannot be derived for a union"),
        "{u:?}"
    );
}

#[test]
fn no_type_params_rejects_dtype_attribute() {
    let e = errors(expand(quote! { #[cast(dtype = E)] struct S { x: f32 } }));
    assert_eq!(
        e,
        ["`E` is not a type parameter of `S`; `S` has no type parameters"]
    );
}
