// rope: rotary position embedding of [rows, head_dim] f32 vectors (row = token * num_heads +
// head), token t at position positions[t], written out of place into `out`.
//
// One invocation per (row, pair slot j < head_dim / 2), over the dispatch's first tensor (x
// into out) and then its second (x_b into out_b, num_rows_b rows of num_heads_b heads; none in
// a dispatch of one tensor): a decoder rotates its queries and keys, whose positions, head
// size and frequencies agree, in one dispatch (src/rope.rs, Rope::prepare_pair). For
// j < rotary_dim / 2 it rotates pair j (NeoX: elements j and j + rotary_dim / 2; GPT-J: 2j and
// 2j + 1); for j >= rotary_dim / 2 it copies elements 2j and 2j + 1 (the partial-rotary tail),
// so every element is written once.
//
// Accuracy does not depend on the adapter's sin/cos or on the size of the position. The host
// gives, per pair, the rotation per token in turns as a 64-bit fixed-point fraction
// F = round(2^64 * theta^(-2j/rotary_dim) / (2 pi)). The angle in turns, modulo one turn, is the
// low 64 bits of position * F, computed exactly with u32 arithmetic; its top two bits (after
// rounding to the nearest quarter turn) are the quadrant, and the remainder, within +-1/8 turn,
// becomes radians in f32 for short minimax polynomials (Cephes sinf/cosf, |r| <= pi/4).

struct RopeParams {
    // Rows (tokens * heads) in this dispatch.
    num_rows: u32,
    num_heads: u32,
    // head_dim / 2.
    half_dim: u32,
    // rotary_dim / 2.
    half_rot: u32,
    // 0: NeoX (half split), 1: GPT-J (adjacent pairs).
    style: u32,
    // Invocations along x of the dispatch grid (64 * workgroups in x).
    stride_x: u32,
    // Rows and heads per token of the second tensor (0 rows: none).
    num_rows_b: u32,
    num_heads_b: u32,
}

@group(0) @binding(0) var<uniform> params: RopeParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// Position of each token of this dispatch.
@group(0) @binding(2) var<storage, read> positions: array<u32>;
// Per pair: (low word, high word) of the 64-bit fixed-point turns per token.
@group(0) @binding(3) var<storage, read> turns: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// The second tensor's input and output (x and out again in a dispatch of one tensor).
@group(0) @binding(5) var<storage, read> x_b: array<f32>;
@group(0) @binding(6) var<storage, read_write> out_b: array<f32>;

// Whether this invocation rotates the second tensor: set once, before any read or write.
var<private> second: bool;

fn x_get(i: u32) -> f32 {
    if second {
        return x_b[i];
    }
    return x[i];
}

fn out_set(i: u32, v: f32) {
    if second {
        out_b[i] = v;
    } else {
        out[i] = v;
    }
}

// 2 pi / 2^32 and 2 pi / 2^64: radians per unit of the high and of the low word.
const RAD_PER_HI_UNIT: f32 = 6.283185307179586 / 4294967296.0;
const RAD_PER_LO_UNIT: f32 = 6.283185307179586 / 18446744073709551616.0;

// High 32 bits of the 64-bit product a * b, from 16-bit halves (no 64-bit integers in WGSL).
fn mul_hi_u32(a: u32, b: u32) -> u32 {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
}

// (sin, cos) of position * F turns.
fn sin_cos_turns(position: u32, f: vec2<u32>) -> vec2<f32> {
    // position * F modulo 2^64, as (hi, lo): the fraction of a turn is hi / 2^32 + lo / 2^64.
    let hi = position * f.y + mul_hi_u32(position, f.x);
    let lo = position * f.x;
    // Nearest quarter turn q, and the remainder in [-1/8, 1/8) turn (in units of 2^-32 turn).
    let shifted = hi + 0x20000000u;
    let q = shifted >> 30u;
    let rem = bitcast<i32>(shifted & 0x3fffffffu) - 0x20000000i;
    let r = f32(rem) * RAD_PER_HI_UNIT + f32(lo) * RAD_PER_LO_UNIT;
    let z = r * r;
    let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r;
    let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z
        - 0.5 * z + 1.0;
    // Angle = q * pi/2 + r.
    let odd = (q & 1u) == 1u;
    var sn = select(s, c, odd);
    var cs = select(c, s, odd);
    if q >= 2u {
        sn = -sn;
    }
    if q == 1u || q == 2u {
        cs = -cs;
    }
    return vec2<f32>(sn, cs);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var i = gid.y * params.stride_x + gid.x;
    var heads = params.num_heads;
    let first = params.num_rows * params.half_dim;
    if i >= first {
        i -= first;
        if i >= params.num_rows_b * params.half_dim {
            return;
        }
        second = true;
        heads = params.num_heads_b;
    }
    let row = i / params.half_dim;
    let j = i % params.half_dim;
    let base = row * 2u * params.half_dim;
    if j >= params.half_rot {
        // Partial-rotary tail: elements 2j and 2j + 1, copied.
        out_set(base + 2u * j, x_get(base + 2u * j));
        out_set(base + 2u * j + 1u, x_get(base + 2u * j + 1u));
        return;
    }
    var a = base + 2u * j;
    var b = a + 1u;
    if params.style == 0u {
        a = base + j;
        b = a + params.half_rot;
    }
    let sc = sin_cos_turns(positions[row / heads], turns[j]);
    let xa = x_get(a);
    let xb = x_get(b);
    out_set(a, xa * sc.y - xb * sc.x);
    out_set(b, xa * sc.x + xb * sc.y);
}
