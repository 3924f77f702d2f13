// f16_check: every f16 bit pattern through unpack2x16float, so the host can compare each with
// the exact integer decoder (src/quant/f16.rs) before any kernel converts f16 that way. Drivers
// may flush f16 subnormals, which a software adapter cannot show. Needs
// SHADER_F16_IN_F32 (`unpack2x16float`).
//
// Invocation i converts patterns 2i (low half) and 2i + 1 (high half) into out[i].

@group(0) @binding(0) var<storage, read_write> out: array<vec2<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * 16384u + gid.x;
    if i >= 32768u {
        return;
    }
    let w = (2u * i) | ((2u * i + 1u) << 16u);
    out[i] = bitcast<vec2<u32>>(unpack2x16float(w));
}
