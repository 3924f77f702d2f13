//! The tiled kernel of the block-format product (`shaders/qmatmul_tiled.wgsl`), for products
//! of many rows (prefill chunks) on GPUs: a workgroup of 256 invocations computes 16 rows of
//! `x` by 16 rows of `W` through 16 KiB of workgroup memory, staging 8 values of 16 chunks of
//! each at a time, so each weight is decoded once per 16 rows of `x` and each `x` value loaded
//! once per 16 rows of `W`. Lane `l` of a group still owns partial `l` of its outputs: the bits
//! of the lane kernel ([`super::qmatmul`]).

/// Rows of `x` per workgroup.
pub(crate) const TILE_X_ROWS: usize = 16;
/// Rows of `W` per workgroup.
pub(crate) const TILE_W_ROWS: usize = 16;
/// The fewest rows for which [`super::qmatmul::QMatmulMapping::for_product`] picks this kernel
/// on a GPU (fewer would leave most of a tile idle).
pub const TILED_MIN_ROWS: usize = 16;
