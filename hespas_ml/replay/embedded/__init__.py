"""Embedded replay of Chakra traces following ASTRA-sim's congestion-unaware analytical model.

This is a discrete-event re-implementation (our own code) of the behaviour of ASTRA-sim 518bd51's
workload and system layers on its congestion-unaware analytical network (facts in
shared/reference/astra-sim.md and shared/astra-vectors/README.md):

* Network (`network`, `engine`): a message of `b` bytes between two ranks takes
  `floor(hops*latency + b/B)` ns, charged on the first dimension (dim 0 varies fastest) where the two
  rank coordinates differ; hops are the shorter way round on a Ring, 1 on FullyConnected, 2 on
  Switch; B = GB/s * 2^30 / 1e9 bytes per ns.  Sends and receives are matched on
  (tag, src, dst, size, sequence number).
* Workload layer (`workload`, `nodes`; per rank): a node is ready when all its data and ctrl
  parents finished; ready nodes are issued in ascending id, at most one GPU COMP, one CPU op and one
  "comm" op (COLL, SEND, MEM, INVALID) in flight, RECV unlimited; a 0 us node takes 1 ns; BROADCAST
  is replayed by duration; replay-only and roofline modes as in ASTRA-sim.
* System layer (`system_layer`, `streams`, `topology`, `collectives`; per rank): a collective is
  cut into chunks (preferred-dataset-splits, with ASTRA-sim's clamping and remainder rules), every
  chunk is a stream with one phase per involved dimension (localBWAware: RS ... AR ... AG; baseline:
  the collective on every dimension), each dimension has a queue running at most
  active-chunks-per-dimension streams; each phase runs the configured algorithm (ring, direct[N],
  halvingDoubling, doubleBinaryTree, and their one* forms) message by message, with endpoint-delay
  (10 ns on a sub-group's local ring) and the local-memory reduction delay
  `3*floor(bytes/local_mem_bw)`.  Collectives are not barriers: each rank progresses on arrivals.

Two engines share this code (`replay`):
* the full engine simulates every rank and every message (exact, used for any input);
* the symmetric engine (`symmetric`) is used when all ranks run the same traces of COMP and
  collective nodes (names and pg_name aside; sub-group collectives in equally sized groups used
  consistently by their members): it simulates rank 0 only and takes each collective phase's
  duration from a one-phase run of the full engine over the ranks of that phase (memoised, checked
  on every peer group).  It falls back to the full engine when a phase is not rank-symmetric
  (doubleBinaryTree, ...).
  `replay_embedded(engine="auto")` uses the full engine for small workloads and the symmetric one for
  large ones.  Both reproduce every recorded ASTRA-sim vector exactly.

Deadlocks (mismatched collectives, a recv without a send, unresolvable dependencies) raise
`ReplayError` naming the stuck ranks and nodes, where ASTRA-sim hangs silently.

Modules: `results` (RankResult, ReplayResult), `config` (system parameters), `network` (delays),
`engine` (event queue, message matching), `topology` (logical rings and trees), `streams` (datasets,
chunk streams, phases), `collectives` (the algorithms), `system_layer` (per-rank Sys), `nodes` (trace
node checks), `workload` (per-rank Workload), `symmetric` (one-rank engine), `replay` (entry point).
"""
from hespas_ml.replay.embedded.config import COLLECTIVE_TAG_BASE
from hespas_ml.replay.embedded.replay import FULL_ENGINE_EVENT_BUDGET, replay_embedded
from hespas_ml.replay.embedded.results import NS_PER_S, RankResult, ReplayResult
from hespas_ml.replay.embedded.system_layer import GROUP_STREAM_BASE

__all__ = ["COLLECTIVE_TAG_BASE", "FULL_ENGINE_EVENT_BUDGET", "GROUP_STREAM_BASE", "NS_PER_S", "RankResult",
           "ReplayResult", "replay_embedded"]
