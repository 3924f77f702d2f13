// add: x[i] += y[i] in place (the residual connection), one f32 addition per element; or,
// with a period, x[i] += y[i mod period] (a bias of `period` values added to every row).
// One invocation per element on a 2-D grid of workgroups.

struct AddParams {
    // Elements in this dispatch.
    n: u32,
    // Invocations along x of the dispatch grid (64 * workgroups in x).
    stride_x: u32,
    // Index of this dispatch's first element inside each binding (the same in both when
    // period is 0; y is then sliced as x is).
    base: u32,
    // 0: plain add. Else y is a bias of `period` values, bound whole.
    period: u32,
    // With a bias: the bias index of this dispatch's first element.
    phase: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: AddParams;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.stride_x + gid.x;
    if i >= params.n {
        return;
    }
    let j = params.base + i;
    // phase < period and i % period < period, so the sum fits a u32 (period < 2^31).
    var k = j;
    if params.period != 0u {
        k = (params.phase + i % params.period) % params.period;
    }
    x[j] = x[j] + y[k];
}
