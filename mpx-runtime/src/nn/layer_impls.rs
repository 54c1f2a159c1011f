//! The dfdx trait impls every `mpx::nn` layer shares, written once as macros: `Module` by way of
//! [`MixedModule`](super::MixedModule) ([`native_module!`]), `BuildOnDevice`
//! ([`build_on_device!`]), `TensorCollection` ([`module_collection!`]), and the bounds of each
//! layer's own forward pass ([`mixed_module!`]).

/// Implements dfdx's `Module` and `NonMutableModule` for an `mpx::nn` layer, by way of its
/// [`MixedModule`] impls, in the element type as the precision (f32, f16, `AMP<f16>`; a layer
/// of f32 elements runs in emulated bf16 inside [`InBf16`](super::InBf16)).
/// `native_module!(Name[const A, ..]; T, ..)` for a layer with type parameters after its
/// device.
macro_rules! native_module {
    ($name:ident [$(const $c:ident),*] $(; $($t:ident),*)?) => {
        $crate::nn::layer_impls::native_module!(@half f32; $name [$(const $c),*] [$($($t),*)?]);
        $crate::nn::layer_impls::native_module!(@half half::f16; $name [$(const $c),*] [$($($t),*)?]);
        $crate::nn::layer_impls::native_module!(
            @half dfdx::dtypes::AMP<half::f16>; $name [$(const $c),*] [$($($t),*)?]
        );
        impl<$(const $c: usize,)* E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E> $($(, $t)*)?>
            dfdx::nn::NonMutableModule for $name<$($c,)* E, D $($(, $t)*)?>
        {
        }
    };
    (@half $e:ty; $name:ident [$(const $c:ident),*] [$($t:ident),*]) => {
        impl<$(const $c: usize,)* $($t,)* X> dfdx::nn::Module<X>
            for $name<$($c,)* $e, dfdx::tensor::Cpu $(, $t)*>
        where
            Self: $crate::nn::MixedModule<$e, X>,
        {
            type Output = <Self as $crate::nn::MixedModule<$e, X>>::Output;
            type Error = dfdx::tensor::CpuError;
            fn try_forward(&self, x: X) -> Result<Self::Output, dfdx::tensor::CpuError> {
                $crate::nn::MixedModule::<$e, X>::try_mixed_forward(self, x)
            }
        }
    };
}
pub(crate) use native_module;

/// Implements dfdx's `BuildOnDevice` for an `mpx::nn` layer type, whatever element and device it
/// names: `dev.build_module::<mpx::nn::LayerNorm1D<8>, f16>()` builds a `LayerNorm1D<8, f16, Cpu>`.
///
/// `build_on_device!(Name[const A, ..], checks: T, ..)` first evaluates the `TYPE_CHECK`
/// constant of each `T` (`Self`, or a part of the layer), so a layer whose const parameters do
/// not fit together fails to compile when it is built.
macro_rules! build_on_device {
    ($name:ident [$(const $c:ident),*]) => {
        $crate::nn::layer_impls::build_on_device!(@impl $name [$(const $c),*] {});
    };
    ($name:ident [$(const $c:ident),*], checks: $($check:ty),+) => {
        $crate::nn::layer_impls::build_on_device!(@impl $name [$(const $c),*] {
            fn try_build_on_device(device: &D) -> Result<Self::Built, D::Err> {
                $(
                    #[allow(clippy::let_unit_value)]
                    let () = <$check>::TYPE_CHECK;
                )+
                <Self::Built as dfdx::nn::BuildModule<D, E>>::try_build(device)
            }
        });
    };
    (@impl $name:ident [$(const $c:ident),*] { $($body:tt)* }) => {
        impl<$(const $c: usize,)* E0: dfdx::shapes::Dtype, D0: dfdx::tensor::Storage<E0>,
            E: dfdx::shapes::Dtype, D: dfdx::tensor_ops::Device<E>>
            dfdx::nn::BuildOnDevice<D, E> for $name<$($c,)* E0, D0>
        where
            $name<$($c,)* E, D>: dfdx::nn::BuildModule<D, E>,
        {
            type Built = $name<$($c,)* E, D>;
            $($body)*
        }
    };
}
pub(crate) use build_on_device;

/// Declares an `mpx::nn` layer made of other layers: the struct, generic over its consts (with
/// their defaults), then its element `E` (default `f32`) and device `D` (default `Cpu`); and its
/// `TensorCollection` ([`module_collection!`]), which visits the fields in declaration order.
macro_rules! composite_layer {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident<$(const $c:ident $(= $default:ident)?),+ $(,)?> {
            $($(#[$fattr:meta])* $fvis:vis $f:ident: $t:ty),+ $(,)?
        }
    ) => {
        $(#[$attr])*
        $vis struct $name<
            $(const $c: usize $(= $default)?,)+
            E: dfdx::shapes::Dtype = f32,
            D: dfdx::tensor::Storage<E> = dfdx::tensor::Cpu,
        > {
            $($(#[$fattr])* $fvis $f: $t,)+
        }
        $crate::nn::layer_impls::module_collection!($name [$(const $c),+] { $($f),+ });
    };
}
pub(crate) use composite_layer;

/// Implements dfdx's `TensorCollection` for an `mpx::nn` layer: visits the named fields, in the
/// order given (the order of the parameters and of their names in a saved model).
///
/// - `module_collection!(Name[const A, ..] { a, b })`, a layer made of other layers: the fields
///   as modules. One impl per float element (f32, f16, `AMP<f16>`), since dfdx's `Linear` needs
///   a concrete one.
/// - `module_collection!(Name[const A, ..] { tensor a: options, scalar b: options })`, a layer
///   of its own tensors and settings: each field as a tensor or a scalar with its
///   `TensorOptions` / `ScalarOptions` (an expression that may name `E` and `D`). One impl for
///   every element.
macro_rules! module_collection {
    ($name:ident [$(const $c:ident),*] { $($f:ident),+ $(,)? }) => {
        $crate::nn::layer_impls::module_collection!(
            @impl [] f32; $name [$(const $c),*] { $(module $f()),+ }
        );
        $crate::nn::layer_impls::module_collection!(
            @impl [] half::f16; $name [$(const $c),*] { $(module $f()),+ }
        );
        $crate::nn::layer_impls::module_collection!(
            @impl [] dfdx::dtypes::AMP<half::f16>; $name [$(const $c),*] { $(module $f()),+ }
        );
    };
    ($name:ident [$(const $c:ident),*] { $($kind:ident $f:ident: $opts:expr),+ $(,)? }) => {
        $crate::nn::layer_impls::module_collection!(
            @impl [E: dfdx::shapes::Dtype,] E; $name [$(const $c),*] { $($kind $f($opts)),+ }
        );
    };
    (
        @impl [$($g:tt)*] $e:ty; $name:ident [$(const $c:ident),*]
        { $($kind:ident $f:ident($($opts:expr)?)),+ }
    ) => {
        impl<$(const $c: usize,)* $($g)* D: dfdx::tensor_ops::Device<$e>>
            dfdx::nn::tensor_collection::TensorCollection<$e, D> for $name<$($c,)* $e, D>
        {
            type To<E2: dfdx::shapes::Dtype, D2: dfdx::tensor_ops::Device<E2>> = $name<$($c,)* E2, D2>;

            fn iter_tensors<Visitor: dfdx::nn::tensor_collection::ModuleVisitor<Self, $e, D>>(
                visitor: &mut Visitor,
            ) -> Result<Option<Self::To<Visitor::E2, Visitor::D2>>, Visitor::Err> {
                visitor.visit_fields(
                    ($(Self::$kind(stringify!($f), |s| &s.$f, |s| &mut s.$f $(, $opts)?),)+),
                    |($($f,)+)| $name { $($f),+ },
                )
            }
        }
    };
}
pub(crate) use module_collection;

/// Implements [`MixedModule`](super::MixedModule) for an `mpx::nn` layer on the CPU, in every
/// precision `P` whose element is the layer's own `E` (`P = E` runs it natively, emulated bf16
/// runs a layer of f32 elements), on an input traced with any tape `T`: the bounds every layer's
/// forward pass shares, written once.
///
/// `mixed_module! { Name[const A, ..], dims [B, ..], fn(self, x: Input) -> Output { .. } }`: the
/// body is `try_mixed_forward`'s (it sees `E`, `P` and `T`), `dims` are the input's dimension
/// parameters (each a `Dim`), and `Name[const A, ..]; X: Bound` adds a type parameter after the
/// device, as in [`native_module!`]. Doc comments go on the impl before the name, on the method
/// before `fn`.
macro_rules! mixed_module {
    (
        $(#[$doc:meta])*
        $name:ident [$(const $c:ident),*] $(; $t:ident: $tb:path)?, dims [$($d:ident),*],
        $(#[$attr:meta])*
        fn($self:ident, $x:tt: $input:ty) -> $output:ty $body:block
    ) => {
        $(#[$doc])*
        impl<$(const $c: usize,)* E, P, $($t,)? $($d,)* T> $crate::nn::MixedModule<P, $input>
            for $name<$($c,)* E, dfdx::tensor::Cpu $(, $t)?>
        where
            E: $crate::precision::Precision<Elem = E> + dfdx::shapes::Dtype,
            P: $crate::precision::Precision<Elem = E>,
            $($t: $tb,)?
            dfdx::tensor::Cpu: dfdx::tensor_ops::Device<E>,
            $($d: dfdx::shapes::Dim,)*
            T: dfdx::tensor::Tape<E, dfdx::tensor::Cpu>,
        {
            type Output = $output;
            $(#[$attr])*
            fn try_mixed_forward(
                &$self,
                $x: $input,
            ) -> ::core::result::Result<Self::Output, dfdx::tensor::CpuError> $body
        }
    };
}
pub(crate) use mixed_module;
