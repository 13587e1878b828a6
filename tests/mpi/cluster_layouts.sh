#!/usr/bin/env bash
# The layout-equivalence harness across hosts: 2 hosts x 2 ranks of the test
# cluster (TCP between the hosts, shared memory inside), the ranks dealt
# round-robin over the hosts (--map-by node) so that loom's placement must
# move them to keep the tensor- and expert-parallel groups inside a host.
# Data parallel, ZeRO-3, tp x dp, pp x dp, ep x dp, context parallel (the
# ring, all-gather and all-to-all crossing the hosts; cp x tp, cp x dp, MoE
# under cp) and 16-bit layouts train like one process, as on one host; so does compressed data parallelism.
# (And the cluster's hosts have no
# address outside its /24 and no route out.)
set -euo pipefail
LAYOUT_TESTS=${LAYOUT_TESTS:?path of loom_layout_tests}
source "$(dirname "$0")/cluster_lib.sh"
cluster_up 2
# The cluster keeps to its /24: no default route, no other address.
for h in 0 1; do
  [[ -z $(ip -n "loom-h$h" route show default) ]] || fail "host $h has a default route"
  addrs=$(ip -n "loom-h$h" -4 -o addr show | awk '{print $4}' | sort | tr '\n' ' ')
  [[ $addrs == "10.233.7.$((h + 1))/24 127.0.0.1/8 " ]] || fail "host $h has addresses $addrs"
done
export LOOM_TEST_LAYOUTS="dp, one bucket per layer|zero-3, prefetch one unit|tp 2 x dp 2, zero-1|pp 2 x dp 2, zero-1|moe, ep 2 x dp 2, zero-3|records, zero-2|cp 4, p2p|cp 4, a2a|cp 4, all_gather|cp 2 x tp 2, p2p|cp 2 x dp 2, p2p, zero-2|moe, cp 2 x dp 2, ep 2"
timeout -k 5 400 "$CLUSTER" mpirun --host node0:2,node1:2 -np 4 --map-by node -x OMP_NUM_THREADS \
  -x LOOM_TEST_LAYOUTS "$LAYOUT_TESTS" --gtest_filter=Layouts.TrainExactlyLikeOneProcess \
  > "$WORK/out.txt" 2>&1 || fail "the harness across hosts failed: $(cat "$WORK/out.txt")"
grep "layout \]" "$WORK/out.txt"
n=$(grep -c "layout \]" "$WORK/out.txt")
((n >= 18)) || fail "only $n layouts ran: $(cat "$WORK/out.txt")"
# Compressed data parallelism across the hosts: PowerSGD and the 1-bit
# optimizers under tp 2 x dp 2 and pp 2 x dp 2 train like one process, and
# the 1-bit phase keeps a pipeline's tied copies equal.
timeout -k 5 400 "$CLUSTER" mpirun --host node0:2,node1:2 -np 4 --map-by node -x OMP_NUM_THREADS \
  "$LAYOUT_TESTS" \
  --gtest_filter=Compression.OnlyTheDataParallelReductionIsCompressed:Compression.OneBitAdamKeepsAPipelinesTiedCopiesEqual \
  > "$WORK/out-compression.txt" 2>&1 ||
  fail "compression across hosts failed: $(cat "$WORK/out-compression.txt")"
grep -q "PASSED .*2 tests" "$WORK/out-compression.txt" ||
  fail "the compression tests did not both run: $(cat "$WORK/out-compression.txt")"
# 0/1 Adam's local steps, the 1-bit optimizers at ZeRO-1 and PowerSGD at
# ZeRO-2/3 across hosts.
timeout -k 5 400 "$CLUSTER" mpirun --host node0:2,node1:2 -np 4 --map-by node -x OMP_NUM_THREADS \
  "$LAYOUT_TESTS" \
  --gtest_filter=Compression.ZeroOneAdamLocalStepsMatchAReference:Compression.ZeroOneAdamSettlesItsIntervalAtASkippedStep:Compression.OneBitOptimizersAtStageOneTrainBitwiseLikeStageZero:Compression.PowerSgdAtStagesTwoAndThree \
  > "$WORK/out-compression-zero.txt" 2>&1 ||
  fail "compression under ZeRO across hosts failed: $(cat "$WORK/out-compression-zero.txt")"
grep -q "PASSED .*4 tests" "$WORK/out-compression-zero.txt" ||
  fail "the compression tests under ZeRO did not all run: $(cat "$WORK/out-compression-zero.txt")"
echo PASS
