"""Logical topologies a rank runs its collective phases on (ASTRA-sim's RingTopology, BinaryTree,
DoubleBinaryTreeTopology and GeneralComplexTopology)."""
from __future__ import annotations

from typing import Sequence, Union

from hespas_ml.replay.embedded.config import ReplayConfig
from hespas_ml.replay.errors import ReplayError

CW, ACW = 0, 1  # ring directions: clockwise, anticlockwise
LEAF, ROOT, INTERMEDIATE = 0, 1, 2  # roles of a rank in a binary tree


class RingTopology:
    """A logical ring over global rank ids; `local` marks a communicator-group ring, whose memory-bus
    bundles take 10 ns instead of endpoint-delay (ASTRA-sim's local-ring shortcut)."""

    __slots__ = ("members", "index", "local", "n", "_pos")

    def __init__(self, members: Sequence[int], index: int, local: bool):
        self.members = tuple(members)
        self.index = index
        self.local = local
        self.n = len(self.members)
        self._pos = {m: i for i, m in enumerate(self.members)}

    def receiver(self, node: int, direction: int) -> int:
        """The rank `node` sends to in `direction`."""
        i = self._pos[node]
        return self.members[(i + 1) % self.n if direction == CW else (i - 1) % self.n]

    def sender(self, node: int, direction: int) -> int:
        """The rank `node` receives from in `direction`."""
        i = self._pos[node]
        return self.members[(i - 1) % self.n if direction == CW else (i + 1) % self.n]

    def key(self) -> tuple:
        """What identifies this ring for memoisation (the same on every rank of the ring)."""
        return ("ring", self.members, self.local)


class _TreeNode:
    __slots__ = ("rank", "parent", "left", "right")

    def __init__(self, parent: _TreeNode | None):
        self.rank = -1
        self.parent = parent
        self.left: _TreeNode | None = None
        self.right: _TreeNode | None = None


class BinaryTree:
    """ASTRA-sim's BinaryTree over ranks start, start+stride, ...: a root with one complete subtree
    (on the right when `root_min`, else on the left), ranks assigned in in-order traversal."""

    def __init__(self, n: int, start: int, stride: int, root_min: bool):
        depth, tmp = 1, n
        while tmp > 1:
            depth += 1
            tmp //= 2

        def grow(levels: int, parent: _TreeNode) -> _TreeNode:
            node = _TreeNode(parent)
            if levels > 1:
                node.left = grow(levels - 1, node)
                node.right = grow(levels - 1, node)
            return node

        root = _TreeNode(None)
        if root_min:
            root.right = grow(depth - 1, root)
        else:
            root.left = grow(depth - 1, root)
        self.nodes: dict[int, _TreeNode] = {}
        next_rank = start

        def number(node: _TreeNode) -> None:
            nonlocal next_rank
            if node.left is not None:
                number(node.left)
            node.rank = next_rank
            self.nodes[next_rank] = node
            next_rank += stride
            if node.right is not None:
                number(node.right)

        number(root)
        if len(self.nodes) != n:
            raise ReplayError(f"doubleBinaryTree needs a power-of-two group size, got {n} "
                              "(ASTRA-sim crashes on it)")

    def role(self, rank: int) -> tuple[int, int, int, int]:
        """(LEAF/ROOT/INTERMEDIATE, parent, left child, right child) of `rank`; -1 for a missing one."""
        node = self.nodes[rank]
        parent = node.parent.rank if node.parent is not None else -1
        left = node.left.rank if node.left is not None else -1
        right = node.right.rank if node.right is not None else -1
        if node.parent is None:
            kind = ROOT
        elif node.left is None and node.right is None:
            kind = LEAF
        else:
            kind = INTERMEDIATE
        return kind, parent, left, right


class DoubleBinaryTreeTopology:
    """Two binary trees (root max, root min) over one dimension, used by alternate chunks."""

    __slots__ = ("n", "trees", "counter")

    def __init__(self, n: int, start: int, stride: int):
        self.n = n
        self.trees = (BinaryTree(n, start, stride, False), BinaryTree(n, start, stride, True))
        self.counter = 0

    def next_tree(self) -> BinaryTree:
        """The tree of the next chunk (they alternate)."""
        tree = self.trees[self.counter % 2]
        self.counter += 1
        return tree


DimTopology = Union[RingTopology, DoubleBinaryTreeTopology]


def global_topology(cfg: ReplayConfig, rank: int, impls: list[tuple[str, int]]) -> list[DimTopology]:
    """Per-dimension logical topologies of `rank` for one collective type (GeneralComplexTopology).

    ring/direct/halvingDoubling use a ring over the dimension; their one* forms one ring over all
    ranks that ends the list; doubleBinaryTree the dimension's pair of trees.
    """
    dims: list[DimTopology] = []
    offset = 1
    last = len(impls) - 1
    for d, (kind, _window) in enumerate(impls):
        n = cfg.npus[d]
        if kind in ("ring", "direct", "halvingDoubling"):
            index = (rank % (offset * n)) // offset
            base = rank - index * offset
            dims.append(RingTopology([base + i * offset for i in range(n)], index, False))
        elif kind in ("oneRing", "oneDirect", "oneHalvingDoubling"):
            dims.append(RingTopology(range(cfg.total), rank % cfg.total, False))
            return dims
        else:  # doubleBinaryTree
            start = rank % offset if d == last else (rank - rank % (offset * n)) + rank % offset
            dims.append(DoubleBinaryTreeTopology(n, start, offset))
        offset *= n
    return dims
