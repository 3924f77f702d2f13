// Two f16 values of a word, element 2i in the low half, by the exact integer decoder (adapters
// without SHADER_F16_IN_F32, or whose unpack2x16float failed the f16 check).
fn kv_half2(w: u32) -> vec2<f32> {
    return kv_unpack_f16x2(w);
}
