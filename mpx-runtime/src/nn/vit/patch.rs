//! [`PatchEmbedding`]: square images cut into square patches, each projected by one `Linear`.

use crate::nn::Linear;
use dfdx::shapes::{Axes5, Const, Dim, Dtype, HasShape};
use dfdx::tensor::{Cpu, CpuError, Storage, Tape, Tensor};
use dfdx::tensor_ops::{Device, PermuteTo, ReshapeTo};

use crate::nn::MixedModule;
use crate::nn::layer_impls::{build_on_device, composite_layer, mixed_module, native_module};
use crate::precision::Precision;

/// Integer square root (the largest `r` with `r * r <= n`), at compile time.
const fn isqrt(n: usize) -> usize {
    let mut r = 0;
    while (r + 1) * (r + 1) <= n {
        r += 1;
    }
    r
}

composite_layer! {
    /// Cuts flattened square images `(B, PIXELS)` into `PATCHES` square patches of `PATCH_DIM`
    /// pixels (row-major patches, each flattened row-major) and projects each to `M` features:
    /// `(B, PATCHES, M)`. The projection is a dfdx `Linear` in the half type (field `linear`).
    ///
    /// `PIXELS`, `PATCH_DIM` and `PATCHES` must be squares with `PIXELS = PATCH_DIM * PATCHES`
    /// (a compile-time error otherwise): 8x8 images in 2x2 patches are
    /// `PatchEmbedding<64, 4, 16, M>`, in 4x4 patches `PatchEmbedding<64, 16, 4, M>`.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::vit::PatchEmbedding;
    /// let dev = Cpu::default();
    /// let embed = dev.build_module::<PatchEmbedding<64, 16, 4, 8>, f32>();
    /// let images: Tensor<Rank2<2, 64>, f32, Cpu> = dev.sample_uniform();
    /// let tokens = embed.forward(images);
    /// assert_eq!(tokens.shape(), &(Const::<2>, Const::<4>, Const::<8>));
    /// ```
    #[derive(Debug, Clone)]
    pub struct PatchEmbedding<const PIXELS, const PATCH_DIM, const PATCHES, const M> {
        /// The projection of one flattened patch.
        pub linear: Linear<PATCH_DIM, M, E, D>,
    }
}

impl<
    const PIXELS: usize,
    const PATCH_DIM: usize,
    const PATCHES: usize,
    const M: usize,
    E: Dtype,
    D: Storage<E>,
> PatchEmbedding<PIXELS, PATCH_DIM, PATCHES, M, E, D>
{
    /// Side of an image, in pixels.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::nn::vit::PatchEmbedding;
    /// assert_eq!(PatchEmbedding::<64, 4, 16, 8>::IMAGE_SIDE, 8);
    /// ```
    pub const IMAGE_SIDE: usize = isqrt(PIXELS);
    /// Side of a patch, in pixels.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::nn::vit::PatchEmbedding;
    /// assert_eq!(PatchEmbedding::<64, 4, 16, 8>::PATCH_SIDE, 2);
    /// ```
    pub const PATCH_SIDE: usize = isqrt(PATCH_DIM);
    /// Fails to compile for a geometry that does not tile.
    pub(crate) const TYPE_CHECK: () = assert!(
        Self::IMAGE_SIDE * Self::IMAGE_SIDE == PIXELS
            && Self::PATCH_SIDE * Self::PATCH_SIDE == PATCH_DIM
            && PATCH_DIM > 0
            && PATCH_DIM * PATCHES == PIXELS
            && Self::IMAGE_SIDE % Self::PATCH_SIDE == 0,
        "PatchEmbedding: PIXELS and PATCH_DIM must be squares, the patch side must divide the image side, and PATCHES = PIXELS / PATCH_DIM"
    );
}

impl<
    const PIXELS: usize,
    const PATCH_DIM: usize,
    const PATCHES: usize,
    const M: usize,
    E: Precision<Elem = E> + Dtype,
    D: Storage<E>,
> PatchEmbedding<PIXELS, PATCH_DIM, PATCHES, M, E, D>
where
    Cpu: Device<E>,
{
    /// Cuts `(B, PIXELS)` images into `(B, PATCHES, PATCH_DIM)` patches (row-major order of
    /// patches, row-major pixels inside each); the tape goes along.
    ///
    /// # Errors
    /// A device error (allocation).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::vit::PatchEmbedding;
    /// let dev = Cpu::default();
    /// // One 4x4 image holding 0..16, cut into four 2x2 patches.
    /// let image = dev.tensor_from_vec((0..16).map(|v| v as f32).collect(), (Const::<1>, Const::<16>));
    /// let patches = PatchEmbedding::<16, 4, 4, 8>::try_patchify(image)?;
    /// assert_eq!(patches.array()[0][0], [0.0, 1.0, 4.0, 5.0]);
    /// assert_eq!(patches.array()[0][1], [2.0, 3.0, 6.0, 7.0]);
    /// assert_eq!(patches.array()[0][3], [10.0, 11.0, 14.0, 15.0]);
    /// # Ok::<(), dfdx::tensor::CpuError>(())
    /// ```
    #[allow(clippy::type_complexity)]
    pub fn try_patchify<B: Dim, T: Tape<E, Cpu>>(
        images: Tensor<(B, Const<PIXELS>), E, Cpu, T>,
    ) -> Result<Tensor<(B, Const<PATCHES>, Const<PATCH_DIM>), E, Cpu, T>, CpuError> {
        #[allow(clippy::let_unit_value)]
        let () = Self::TYPE_CHECK;
        let b = images.shape().0;
        let (p, g) = (Self::PATCH_SIDE, Self::IMAGE_SIDE / Self::PATCH_SIDE);
        // (B, grid row, pixel row, grid column, pixel column) -> patches first.
        let x = images.try_reshape_like(&(b, g, p, g, p))?;
        let x = x.try_permute::<_, Axes5<0, 1, 3, 2, 4>>()?;
        x.try_reshape_like(&(b, Const::<PATCHES>, Const::<PATCH_DIM>))
    }
}

build_on_device!(PatchEmbedding[const PIXELS, const PATCH_DIM, const PATCHES, const M], checks: Self);

native_module!(PatchEmbedding[const PIXELS, const PATCH_DIM, const PATCHES, const M]);

mixed_module! {
    PatchEmbedding[const PIXELS, const PATCH_DIM, const PATCHES, const M], dims [B],
    fn(self, images: Tensor<(B, Const<PIXELS>), E, Cpu, T>)
        -> Tensor<(B, Const<PATCHES>, Const<M>), E, Cpu, T>
    {
        MixedModule::<P, _>::try_mixed_forward(&self.linear, Self::try_patchify(images)?)
    }
}
