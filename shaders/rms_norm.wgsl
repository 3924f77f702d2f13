// rms_norm: Llama RMSNorm of [rows, dim] f32 rows, out of place:
//
//   out[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * weight[i]
//
// One workgroup per row (row = workgroup_id.y * groups_x + workgroup_id.x), three passes over
// the row: the largest |x|, the sum of squares of the row scaled by a power of two, and the
// output. The reductions take TREE partials (partial v: elements v, v + TREE, ... in index
// order), which meet in a fixed tree in workgroup memory; the WG invocations share them (WG =
// TREE, one each, on GPUs; 8 invocations taking TREE / 8 each on CPU adapters, the same sums
// in the same order). So a row's result depends only on the row and TREE (not on the batch
// around it, where its chunk is bound, or WG).
//
// Overflow-free for every finite input: the row is scaled by 2^k (exact) so that its largest
// magnitude lies in [1, 2) (k is clamped to keep 2^k a normal f32), and
//
//   1 / sqrt(mean + eps) = 2^k / sqrt(mean(scaled^2) + eps * 2^2k).
//
// When eps * 2^2k >= 2^40 (tiny rows; decided from the exponents, so 2^2k is never formed) the
// mean is negligible and the factor is 1 / sqrt(eps) on the unscaled row. A row whose
// mean + eps is 0 (zeros, eps = 0) gives zeros.

struct RmsNormParams {
    // Rows in this dispatch.
    rows: u32,
    dim: u32,
    eps: f32,
    // Workgroups along x of the dispatch grid.
    groups_x: u32,
    // Index of this dispatch's first row inside the x and out bindings.
    x_base: u32,
    out_base: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: RmsNormParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// Invocations per workgroup (a power of two, at most TREE) and partial sums per reduction
// (a power of two): the host's min(256, the device's limit) for both, or WG = 8 on CPU adapters.
override WG: u32 = 256u;
override TREE: u32 = 256u;
// log2 of 2^40: past this, eps * 2^2k dwarfs the scaled mean (< 16) by more than 2^36.
const EPS_DOMINATES_LOG2: i32 = 40;

// floor(log2(eps)) from its bits, subnormals included; -1000 for 0 (never "dominates").
fn eps_log2(eps: f32) -> i32 {
    let bits = bitcast<u32>(eps) & 0x7fffffffu;
    let field = i32(bits >> 23u);
    let man = bits & 0x7fffffu;
    if bits == 0u {
        return -1000;
    }
    return select(field - 127, i32(firstLeadingBit(man)) - 149, field == 0);
}

var<workgroup> partial: array<f32, TREE>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.y * params.groups_x + wid.x;
    if row >= params.rows {
        return;
    }
    let dim = params.dim;
    let xb = params.x_base + row * dim;

    // Pass 1: the largest magnitude (exact, any order).
    for (var v = lid; v < TREE; v += WG) {
        var m = 0.0;
        for (var i = v; i < dim; i += TREE) {
            m = max(m, abs(x[xb + i]));
        }
        partial[v] = m;
    }
    workgroupBarrier();
    for (var s = TREE / 2u; s > 0u; s >>= 1u) {
        for (var v = lid; v < s; v += WG) {
            partial[v] = max(partial[v], partial[v + s]);
        }
        workgroupBarrier();
    }
    let mx = partial[0];
    workgroupBarrier();

    // 2^k with k = 127 - (biased exponent of mx), clamped to [-126, 126]: mx * 2^k in [1, 2)
    // for normal mx.
    let e = i32((bitcast<u32>(mx) >> 23u) & 0xffu);
    let k = clamp(127 - e, -126, 126);
    let scale = bitcast<f32>(u32(k + 127) << 23u);

    // Pass 2: sum of squares of the scaled row, in a fixed order.
    for (var v = lid; v < TREE; v += WG) {
        var acc = 0.0;
        for (var i = v; i < dim; i += TREE) {
            let e = x[xb + i] * scale;
            acc += e * e;
        }
        partial[v] = acc;
    }
    workgroupBarrier();
    for (var s = TREE / 2u; s > 0u; s >>= 1u) {
        for (var v = lid; v < s; v += WG) {
            partial[v] = partial[v] + partial[v + s];
        }
        workgroupBarrier();
    }
    let mean_scaled = partial[0] / f32(dim);

    // Pass 3: the output. No intermediate leaves f32's finite range: WGSL lets a compiler
    // assume that none does, and one that does (2^2k, 1 / sqrt(0)) came out NaN on a real
    // driver. So eps * 2^2k is judged by exponents before it is formed, and 0 is never the
    // argument of inverseSqrt.
    let eps = params.eps;
    let direct = eps_log2(eps) + 2 * k >= EPS_DOMINATES_LOG2;
    // Not direct: eps * 2^2k < 2^40, formed in two exact steps of 2^k (|k| <= 126, so each
    // ldexp's exponent is in range, and neither step leaves f32's range). Direct: steps of 2^0,
    // since a select evaluates both sides and eps * 2^k may overflow there.
    let ke = select(k, 0, direct);
    let eps_scaled = select(ldexp(ldexp(eps, ke), ke), 0.0, direct);
    let d = mean_scaled + eps_scaled;
    let zero = d == 0.0;
    var factor = select(inverseSqrt(select(d, 1.0, zero)), 0.0, zero);
    var pre = scale;
    if direct {
        factor = inverseSqrt(eps);
        pre = 1.0;
    }
    let ob = params.out_base + row * dim;
    for (var i = lid; i < dim; i += WG) {
        out[ob + i] = x[xb + i] * pre * factor * weight[i];
    }
}
