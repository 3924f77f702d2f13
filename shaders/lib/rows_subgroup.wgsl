// rows_subgroup.wgsl: the paged kernel's per-row reductions with subgroup operations (needs
// SUBGROUP): each subgroup reduces its share of a row's WG scores at once, and one invocation per
// row combines the subgroups' partials. Same functions as rows_portable.wgsl, and the entry point
// passing the subgroup builtins.

// Subgroups per workgroup at most: WG over the smallest subgroup size wgpu allows (4).
const MAX_SUBGROUPS: u32 = 16u;

var<workgroup> sg_part: array<f32, MAX_TILE * MAX_SUBGROUPS>;
var<private> sg_id: u32;
var<private> sg_count: u32;
var<private> sg_lane: u32;

fn rows_update_max(tid: u32, n_rows: u32) {
    for (var t = 0u; t < n_rows; t++) {
        let m = subgroupMax(scores[t * WG + tid]);
        if sg_lane == 0u {
            sg_part[t * MAX_SUBGROUPS + sg_id] = m;
        }
    }
    workgroupBarrier();
    if tid < n_rows {
        var m = row_max[tid];
        for (var g = 0u; g < sg_count; g++) {
            m = max(m, sg_part[tid * MAX_SUBGROUPS + g]);
        }
        row_alpha[tid] = exp(row_max[tid] - m);
        row_max[tid] = m;
    }
}

fn rows_update_sum(tid: u32, n_rows: u32) {
    for (var t = 0u; t < n_rows; t++) {
        let l = subgroupAdd(scores[t * WG + tid]);
        if sg_lane == 0u {
            sg_part[t * MAX_SUBGROUPS + sg_id] = l;
        }
    }
    workgroupBarrier();
    if tid < n_rows {
        var l = 0.0;
        for (var g = 0u; g < sg_count; g++) {
            l += sg_part[tid * MAX_SUBGROUPS + g];
        }
        row_sum[tid] = row_sum[tid] * row_alpha[tid] + l;
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_id) group: u32,
    @builtin(num_subgroups) groups: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    sg_id = group;
    sg_count = groups;
    sg_lane = lane;
    attend(wid, tid);
}
