// fma_rate: the kernel that measures an adapter's arithmetic ceiling (ARCHITECTURE.md section 13).
// Each invocation runs eight independent chains of vec4 fused multiply-adds in the precision
// prelude's `real` (f32, or f16 where the adapter has it), `iters` steps each, and writes their
// sum so that nothing is optimized away: 64 floating-point operations per step.

struct FmaParams {
    // Steps of every chain.
    iters: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: FmaParams;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    // Start values and factors the compiler cannot know: they depend on the invocation and on
    // the uniform.
    let x = real(f32(gid.x & 1023u) * 1.0e-4);
    let m = real4(real(0.9995) + x * real(1.0e-3));
    let c = real4(real(1.0e-4) * real(f32(params.iters & 7u)));
    var a0 = real4(x, x + real(0.1), x + real(0.2), x + real(0.3));
    var a1 = a0 + real4(real(0.01));
    var a2 = a0 + real4(real(0.02));
    var a3 = a0 + real4(real(0.03));
    var a4 = a0 + real4(real(0.04));
    var a5 = a0 + real4(real(0.05));
    var a6 = a0 + real4(real(0.06));
    var a7 = a0 + real4(real(0.07));
    for (var i = 0u; i < params.iters; i++) {
        a0 = fma(a0, m, c);
        a1 = fma(a1, m, c);
        a2 = fma(a2, m, c);
        a3 = fma(a3, m, c);
        a4 = fma(a4, m, c);
        a5 = fma(a5, m, c);
        a6 = fma(a6, m, c);
        a7 = fma(a7, m, c);
    }
    out[gid.x] = vec4<f32>(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)));
}
