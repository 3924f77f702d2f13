// Two f16 values of a word, element 2i in the low half, by unpack2x16float: used only where the
// context's f16 check found it exact for all 65,536 patterns (src/gpu/f16_check.rs).
fn kv_half2(w: u32) -> vec2<f32> {
    return unpack2x16float(w);
}
