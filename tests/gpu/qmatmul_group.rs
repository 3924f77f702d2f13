//! Several block-format products of one row of x in one dispatch
//! (`kvattn::decoder::ops::qmatmul_group`): each output has the bits of its own product and
//! nothing past its rows is written; groups the row kernel cannot take are refused before
//! anything is written.

use kvattn::decoder::gguf::GgmlType;
use kvattn::decoder::ops::qmatmul::{
    input_buffer, prepare_qmatmul_mapped, QMatmulArgs, QMatmulMapping, QWeight,
};
use kvattn::decoder::ops::qmatmul_group::{can_group, prepare_qmatmul_group, GroupOutput};
use kvattn::decoder::ops::PreparedOp;
use kvattn::gpu::{Context, UNWRITTEN, UNWRITTEN_BITS};
use kvattn::Error;

use crate::common::{gpu, Rng};
use crate::qmatmul::{random_weight, window_rows};

/// Runs `op` and reads back `len` values of each of `ys`.
fn run(ctx: &Context, op: &PreparedOp, ys: &[&wgpu::Buffer], len: &[usize]) -> Vec<Vec<f32>> {
    ctx.run_pass("qmatmul group", |pass| {
        op.encode(pass);
        Ok(())
    })
    .unwrap();
    ys.iter()
        .zip(len)
        .map(|(y, &n)| ctx.read_back::<f32>(y, n).unwrap())
        .collect()
}

/// Q, K and V-like weights (several windows, one, and one plus a few rows) of three types: the
/// group's outputs equal the row kernel's product of each weight alone bit for bit, in fewer
/// dispatches, and the sentinel after each output's rows survives.
#[test]
fn a_group_gives_each_output_the_bits_of_its_own_product() {
    let ctx = gpu();
    let mut rng = Rng::new(41);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K] {
        let k = if ty.block_size() == 256 { 512 } else { 96 };
        let wr = window_rows(ty, k);
        let shapes = [4 * wr + 5, wr, wr + 7];
        let weights: Vec<QWeight> = shapes
            .iter()
            .map(|&n| {
                let bytes = random_weight(&mut rng, ty, n, k);
                QWeight::upload(ctx, "w", ty, (n, k), &bytes).unwrap()
            })
            .collect();
        let x = input_buffer(ctx, "x", &rng.normals(2 * k, 1.0)).unwrap();
        let fresh = |n: usize| ctx.upload("y", &vec![UNWRITTEN; n + 3]).unwrap();
        let ys: Vec<wgpu::Buffer> = shapes.iter().map(|&n| fresh(n)).collect();
        let outputs: Vec<GroupOutput> = weights
            .iter()
            .zip(&ys)
            .map(|(w, y)| GroupOutput { w, y })
            .collect();
        let lens: Vec<usize> = shapes.iter().map(|n| n + 3).collect();
        if !ctx.caps().cpu_adapter {
            // GPUs upload no windows: the group is the row kernel's, for CPU adapters only.
            assert!(!can_group(ctx, &x, 1, &outputs));
            assert!(matches!(
                prepare_qmatmul_group(ctx, &x, 1, &outputs),
                Err(Error::InvalidArgument(_))
            ));
            return;
        }
        assert!(can_group(ctx, &x, 1, &outputs), "{ty}");
        let op = prepare_qmatmul_group(ctx, &x, 1, &outputs).unwrap();
        let y_refs: Vec<&wgpu::Buffer> = ys.iter().collect();
        let got = run(ctx, &op, &y_refs, &lens);
        let mut alone_dispatches = 0;
        for (d, w) in weights.iter().enumerate() {
            let y = fresh(shapes[d]);
            let args = QMatmulArgs {
                x: &x,
                x_row: 1,
                rows: 1,
                w,
                y: &y,
                y_row: 0,
                accumulate: false,
            };
            let alone = prepare_qmatmul_mapped(ctx, &args, QMatmulMapping::Rows).unwrap();
            alone_dispatches += alone.num_dispatches();
            let want = run(ctx, &alone, &[&y], &[lens[d]]).remove(0);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let (g, w) = (bits(&got[d]), bits(&want));
            let differ: Vec<usize> = (0..g.len()).filter(|&i| g[i] != w[i]).collect();
            assert!(
                differ.is_empty(),
                "{ty}: output {d}: {} of {} values differ from the product alone, from {:?}",
                differ.len(),
                g.len(),
                &differ[..differ.len().min(8)]
            );
            assert!(
                got[d][..shapes[d]]
                    .iter()
                    .all(|v| v.to_bits() != UNWRITTEN_BITS),
                "{ty}: output {d} has unwritten rows"
            );
            assert!(
                got[d][shapes[d]..]
                    .iter()
                    .all(|v| v.to_bits() == UNWRITTEN_BITS),
                "{ty}: output {d} written past its rows"
            );
        }
        assert!(
            op.num_dispatches() < alone_dispatches,
            "{ty}: {} dispatches grouped, {alone_dispatches} alone",
            op.num_dispatches()
        );
    }
}

/// Groups the row kernel cannot take are refused, naming why, and write nothing.
#[test]
fn groups_the_row_kernel_cannot_take_are_refused() {
    let ctx = gpu();
    let mut rng = Rng::new(43);
    let upload = |rng: &mut Rng, ty: GgmlType, n: usize, k: usize| {
        let bytes = random_weight(rng, ty, n, k);
        QWeight::upload(ctx, "w", ty, (n, k), &bytes).unwrap()
    };
    let k = 96;
    let n = window_rows(GgmlType::Q4_1, k);
    let a = upload(&mut rng, GgmlType::Q4_1, n, k);
    let b = upload(&mut rng, GgmlType::Q8_0, window_rows(GgmlType::Q8_0, k), k);
    let c = upload(&mut rng, GgmlType::Q4_1, n, 2 * k);
    let x = input_buffer(ctx, "x", &rng.normals(2 * k, 1.0)).unwrap();
    let y: Vec<wgpu::Buffer> = (0..5)
        .map(|_| ctx.upload("y", &vec![UNWRITTEN; 4 * n]).unwrap())
        .collect();
    let refused = |outputs: &[GroupOutput]| match prepare_qmatmul_group(ctx, &x, 0, outputs) {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    // No outputs; more than three; two types; two row lengths: can_group says no too.
    let cannot = [
        vec![],
        (0..4).map(|i| GroupOutput { w: &a, y: &y[i] }).collect(),
        vec![
            GroupOutput { w: &a, y: &y[0] },
            GroupOutput { w: &b, y: &y[1] },
        ],
        vec![
            GroupOutput { w: &a, y: &y[0] },
            GroupOutput { w: &c, y: &y[1] },
        ],
    ];
    for outputs in &cannot {
        assert!(!can_group(ctx, &x, 0, outputs));
        refused(outputs);
    }
    // One output buffer twice, or x as an output.
    refused(&[
        GroupOutput { w: &a, y: &y[0] },
        GroupOutput { w: &a, y: &y[0] },
    ]);
    refused(&[GroupOutput { w: &a, y: &x }]);
    for b in &y {
        let back = ctx.read_back::<f32>(b, 4 * n).unwrap();
        assert!(back.iter().all(|v| v.to_bits() == UNWRITTEN_BITS));
    }
}
