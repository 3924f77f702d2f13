//! Host mirrors of WGSL structs, with the field offsets a test checks against naga's layout.

/// A `#[repr(C)]` struct that mirrors a WGSL struct of the same name. Declare it with
/// [`wgsl_struct!`](crate::wgsl_struct) so that its field offsets are listed for the layout test.
pub trait WgslStruct: bytemuck::Pod {
    /// Name of the WGSL struct it mirrors.
    const WGSL_NAME: &'static str;
    /// `(field name, byte offset)` of every field, in declaration order.
    fn field_offsets() -> Vec<(&'static str, usize)>;
}

/// Declares a `#[repr(C)]`, `Pod` struct mirroring the WGSL struct of the same name and
/// implements [`WgslStruct`] for it.
#[macro_export]
macro_rules! wgsl_struct {
    ($(#[$meta:meta])* $vis:vis struct $name:ident {
        $($(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty),* $(,)?
    }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $($(#[$fmeta])* $fvis $field: $ty),*
        }
        impl $crate::gpu::WgslStruct for $name {
            const WGSL_NAME: &'static str = stringify!($name);
            fn field_offsets() -> Vec<(&'static str, usize)> {
                vec![$((stringify!($field), std::mem::offset_of!($name, $field))),*]
            }
        }
    };
}
