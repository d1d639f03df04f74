"""Forward with a 2x1 thread-block cluster along M (FwdConfig.cluster_m = 2).

The two CTAs of a cluster take adjacent query blocks 2p, 2p+1 of one (head, batch). Without a
causal/local mask both visit the same key blocks in the same order, so every K and V tile is
needed by both: each CTA loads half of the tile's rows and multicasts that half to both CTAs.

  full barriers (per CTA): the local producer's arrive + the whole tile's bytes, of which half
      come from the peer's multicast.
  empty barriers (per CTA): one arrive per consumer warp of *both* CTAs (lane r of each consumer
      warp arrives on rank r's barrier), because a stage of ours is overwritten by both
      producers' loads.
  teardown: each producer waits until every stage is empty (producer tail), i.e. until the peer's
      consumers have made their last remote arrive on our barriers, before the CTA may exit.

With an odd number of query blocks the second CTA of the last pair gets block num_m_blocks: its Q
load is out of bounds (TMA fills zeros), its O store and LSE writes fall outside the tensor (TMA
clips the store, the LSE write is guarded), but it takes part in every load and barrier.
(docs/decisions.md)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync


def cta_layout_vmnk(cluster_m: int):
    """The cluster as PipelineTmaAsync sees it: (1, cluster_m, 1, 1)."""
    return cute.make_layout((1, cluster_m, 1, 1))


def kv_consumer_group(cluster_m: int, num_consumer_threads: int):
    """Empty-barrier arrive count of the K/V rings: one per consumer warp per CTA of the cluster."""
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, cluster_m * num_consumer_threads // 32)


def kv_tma_op(cluster_m: int):
    if cluster_m > 1:
        return cpasync.CopyBulkTensorTileG2SMulticastOp()
    return cpasync.CopyBulkTensorTileG2SOp()


def mcast_mask(cluster_m: int):
    """Every CTA of the cluster receives each half."""
    return cutlass.Int16((1 << cluster_m) - 1)
