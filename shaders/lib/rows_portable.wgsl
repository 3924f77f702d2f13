// rows_portable.wgsl: how the paged kernel reduces each row's chunk of WG scores (its running
// max, then its running sum), one invocation per row in core WGSL; and the kernel's entry point.
// The subgroup variant (rows_subgroup.wgsl) defines the same functions with subgroup
// reductions. Uses the kernel's `scores`, `row_max`, `row_alpha`, `row_sum` and `attend`.

// New running max of each row and the factor rescaling what came before.
fn rows_update_max(tid: u32, n_rows: u32) {
    if tid < n_rows {
        var m = row_max[tid];
        for (var i = 0u; i < WG; i++) {
            m = max(m, scores[tid * WG + i]);
        }
        row_alpha[tid] = exp(row_max[tid] - m);
        row_max[tid] = m;
    }
}

// Running sum of each row's probabilities.
fn rows_update_sum(tid: u32, n_rows: u32) {
    if tid < n_rows {
        var l = 0.0;
        for (var i = 0u; i < WG; i++) {
            l += scores[tid * WG + i];
        }
        row_sum[tid] = row_sum[tid] * row_alpha[tid] + l;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    attend(wid, tid);
}
