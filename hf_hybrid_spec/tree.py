"""Draft trees: what a drafter proposes, and the verify input the target model sees.

A drafter proposes `DraftTree` nodes hanging off the *root*, the last committed token (already chosen,
not yet run through the target). The generate loop prepends the root to get a `VerifyTree` of N = M + 1
nodes, runs it through the target in one forward, and commits the accepted root->leaf path.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from .kernels.tree import ancestor_mask, node_depth, validate_parent

__all__ = ["DraftTree", "DraftBatch", "DeviceDrafts", "HostTree", "VerifyTree", "VerifyResult", "additive_mask",
           "build_verify_tree", "chain_tree", "empty_draft", "tree_attention_mask", "trim_draft"]


@dataclass
class HostTree:
    """Batch row 0 of a `DraftTree` as Python lists (see `DraftTree.host`)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float] | None


@dataclass
class DraftTree:
    """Candidate continuations proposed by a drafter, in topological order.

    Attributes:
        tokens: [B, M] int64 draft tokens.
        parents: [B, M] int64; index of each node's parent among the draft nodes, -1 for children of the root.
        probs: optional [B, M, V] float32; the draft distribution q (at the parent) that each node was *sampled*
            from. Siblings that carry probs must be independent draws from the same q (duplicates allowed, not
            deduplicated). None means the tree was built deterministically (greedy, top-k or a cache match):
            sampling verification then treats every node as a one-hot proposal, which keeps it lossless.
        scores: optional [B, M] float32; the drafter's own estimate that each node gets accepted (e.g. path
            probability), used to trim a tree to a budget.
        info: optional drafter-specific facts about the proposal (match length, source, expected accepted
            length...), recorded for analysis and payoff prediction; never used by verification.
        next_probs: optional [B, M + 1, V] float32; the drafter's full next-token distribution after the root
            (row 0) and after each draft node j (row j + 1), leaves included. Only lossy verification
            (`verification="cospec" | "fly" | "typical"`) reads it, to know the draft's own choice at
            every node; unlike `probs` it says nothing about how the nodes were drawn.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    info: dict | None = None
    next_probs: torch.Tensor | None = None

    def __post_init__(self):
        if self.tokens.ndim != 2 or self.parents.shape != self.tokens.shape:
            raise ValueError(
                f"tokens and parents must both be [B, M], got {tuple(self.tokens.shape)} and {tuple(self.parents.shape)}"
            )
        if self.tokens.shape[1] > 0:
            validate_parent(self.parents)
        if self.probs is not None and self.probs.shape[:2] != self.tokens.shape:
            raise ValueError(f"probs must be [B, M, V] with [B, M] = {tuple(self.tokens.shape)}")
        if self.next_probs is not None and (
            self.next_probs.ndim != 3 or self.next_probs.shape[:2] != (self.tokens.shape[0], self.tokens.shape[1] + 1)
        ):
            raise ValueError(f"next_probs must be [B, M + 1, V] with [B, M] = {tuple(self.tokens.shape)}")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def host(self) -> HostTree:
        """Row 0's tokens, parents and scores as Python lists, read from the tensors once per tree and kept (the
        tensors are never modified in place). Host-side policies (HVD) walk a draft every step: one read instead of
        one per walk, and none for drafts built from lists (`from_lists`)."""
        lists = self.__dict__.get("_host")
        if lists is None:
            lists = HostTree(self.tokens[0].tolist(), self.parents[0].tolist(),
                             None if self.scores is None else self.scores[0].tolist())
            self.__dict__["_host"] = lists
        return lists

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int], scores: list[float] | None = None,
                   info: dict | None = None) -> DraftTree:
        """A deterministic host-side draft of batch size 1 from Python lists, as cache drafters build one per step.

        Checked on the lists (`-1 <= parents[i] < i`), which for a small tree is several times cheaper than the
        tensor check of the constructor: the drafting is on the critical path of every step. The lists are kept as
        `host()`.
        """
        if len(parents) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
            raise ValueError(f"tokens, parents and scores must have one entry per node, got {len(tokens)}, "
                             f"{len(parents)} and {None if scores is None else len(scores)}")
        if any(not -1 <= p < i for i, p in enumerate(parents)):
            raise ValueError("parent[b, i] must satisfy -1 <= parent[b, i] < i (nodes in topological order)")
        tree = _ListDraft.__new__(_ListDraft)  # the lists were checked above; the tensors are made when first read
        tree.probs = tree.next_probs = None
        tree.info = info
        # Scores as a float32 tensor holds them (`array("f")` rounds as torch does): features read from the lists or
        # the tensor agree to the bit.
        tree.__dict__["_host"] = HostTree(list(tokens), list(parents),
                                          None if scores is None else array("f", scores).tolist())
        return tree

    def relabeled(self, info: dict | None) -> DraftTree:
        """The same nodes, tokens, parents and scores (shared, not copied; host lists included) read as a
        deterministic draft (no `probs` / `next_probs`) with `info` replaced: what a drafter that picks among other
        drafters' trees (HVD) returns every step. Not re-validated (the nodes were, when this tree was built), and
        cheaper than `copy.copy` plus the dataclass fields."""
        tree = type(self).__new__(type(self))
        tree.__dict__.update(self.__dict__)
        tree.probs = tree.next_probs = None
        tree.info = info
        return tree

    def depth(self) -> torch.Tensor:
        """[B, M] depth of each draft node below the root (children of the root have depth 1)."""
        return node_depth(self.parents) + 1

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than `max_depth` below the root (batch size 1)."""
        if max_depth <= 0 and self.next_probs is not None:
            # Lossy verification still arbitrates the token after the root: keep row 0.
            return self.select(torch.zeros(0, dtype=torch.long, device=self.tokens.device))
        if self.num_nodes == 0 or max_depth <= 0:
            return empty_draft(self.tokens.shape[0], self.tokens.device) if max_depth <= 0 else self
        keep = (self.depth()[0] <= max_depth).nonzero().flatten()
        return self.select(keep)

    def select(self, keep: torch.Tensor) -> DraftTree:
        """Keep the nodes `keep` (sorted indices, closed under taking parents; batch size 1)."""
        if keep.numel() == self.num_nodes:
            return self
        remap = torch.full((self.num_nodes + 1,), -1, dtype=torch.long, device=self.tokens.device)
        remap[keep] = torch.arange(keep.numel(), device=self.tokens.device)
        par = self.parents[0, keep]
        new_par = torch.where(par >= 0, remap[par.clamp(min=0)], -1)
        if bool(((par >= 0) & (new_par < 0)).any()):
            raise ValueError("select() must keep every kept node's parent")
        return DraftTree(
            tokens=self.tokens[:, keep],
            parents=new_par.unsqueeze(0),
            probs=None if self.probs is None else self.probs[:, keep],
            scores=None if self.scores is None else self.scores[:, keep],
            info=self.info,
            next_probs=None if self.next_probs is None
            else self.next_probs[:, torch.cat([keep.new_zeros(1), keep + 1]).to(self.next_probs.device)],
        )


def _from_host(name: str):
    """Field `name` (tokens, parents or scores) of a `_ListDraft`: a [1, M] tensor made from its host lists when first
    read, then kept; assigning it (dataclasses.replace builds through `__init__`) stores the value given."""
    dtype = torch.float32 if name == "scores" else torch.long

    def get(self):
        found = self.__dict__.get(name, _UNSET)
        if found is _UNSET:
            values = getattr(self.__dict__["_host"], name)
            found = None if values is None else torch.tensor(values, dtype=dtype).view(1, len(values))
            self.__dict__[name] = found
        return found

    def put(self, value):
        self.__dict__[name] = value

    return property(get, put)


_UNSET = object()


class _ListDraft(DraftTree):
    """A `DraftTree` built from host lists (`DraftTree.from_lists`): cache drafters build one per row and step, and
    the batch and serving steps read only the lists (`host()`, `DraftBatch.from_drafts`), so its tensors are made
    only if something reads them (a single request's verify tree, a tensor trim)."""

    tokens = _from_host("tokens")
    parents = _from_host("parents")
    scores = _from_host("scores")

    @property
    def num_nodes(self) -> int:
        host = self.__dict__.get("_host")
        return len(host.tokens) if host is not None else self.tokens.shape[1]


# Empty drafts by (batch size, device): a cache drafter without a match returns one every step, and drafts are never
# modified in place (see `DraftTree.host`), so one is shared.
_EMPTY: dict[tuple[int, str], DraftTree] = {}


def empty_draft(batch_size: int = 1, device: torch.device | str = "cpu") -> DraftTree:
    """A draft of no nodes (the step verifies the root alone), shared: never modify it."""
    key = (batch_size, str(device))
    tree = _EMPTY.get(key)
    if tree is None:
        z = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        tree = _EMPTY[key] = DraftTree(tokens=z, parents=z.clone())
    return tree


def chain_tree(tokens: torch.Tensor, probs: torch.Tensor | None = None) -> DraftTree:
    """A chain draft: tokens [B, M], each the child of the previous one."""
    b, m = tokens.shape
    parents = (torch.arange(m, device=tokens.device) - 1).expand(b, m).clone()
    return DraftTree(tokens=tokens, parents=parents, probs=probs)


@dataclass
class DraftBatch:
    """The drafts of one batch step, one row per running row, as padded host tensors: what the batch loop budgets,
    lays out and verifies with a few tensor ops per step instead of a Python walk per row and node.

    Attributes:
        tokens: [R, M] int64; row r's draft nodes are 0 .. count[r] - 1 (topological order), the rest padding.
        parents: [R, M] int64, each node's parent among its row's nodes, -1 under the root (padding: -1).
        values: [R, M] float32, each node's value for the budget: the drafter's estimate that it is accepted (its
            path probability; `prior ** depth` without scores), never above its parent's (padding: 0).
        depth: [R, M] int64 depth below the root (children of the root: 1; padding: 0).
        count: [R] int64 nodes per row.
        drafts: the rows' own DraftTrees when they were drafted one per row (rules other than raw greedy read them:
            sampled `probs`, `next_probs`), else None.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    values: torch.Tensor
    depth: torch.Tensor
    count: torch.Tensor
    drafts: list[DraftTree] | None = None

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def valid(self) -> torch.Tensor:
        """[R, M] bool: the real nodes."""
        return torch.arange(self.tokens.shape[1]) < self.count[:, None]

    @property
    def counts(self) -> list[int]:
        """Nodes per row as a Python list (read once)."""
        found = self.__dict__.get("_counts")
        if found is None:
            found = self.__dict__["_counts"] = self.count.tolist()
        return found

    @classmethod
    def from_tensors(cls, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor | None,
                     count: torch.Tensor, prior: float = 0.6, drafts: list[DraftTree] | None = None) -> DraftBatch:
        """From padded host tensors ([R, M]; `scores` the drafter's acceptance estimates or None for `prior ** depth`):
        depths worked out and values capped at their parents' (so any set of the likeliest nodes is closed under
        parents), in a few passes over the batch."""
        rows, width = tokens.shape
        valid = torch.arange(width) < count[:, None]
        parents = torch.where(valid, parents, -1)
        under = parents >= 0
        up = parents.clamp(min=0)
        depth = valid.long()
        values = scores.float().clamp(0.0, 1.0) if scores is not None else torch.full((rows, width), prior)
        values = torch.where(valid, values, 0.0)
        # Topological order: one pass per level settles the next level's depth and cap (at most the tree's depth).
        for _ in range(width):
            new_depth = torch.where(under, depth.gather(1, up) + 1, depth)
            if scores is None:
                new_values = torch.where(valid, torch.full_like(values, prior) ** new_depth.float(), 0.0)
            else:
                new_values = torch.where(under, torch.minimum(values, values.gather(1, up)), values)
            if torch.equal(new_depth, depth) and torch.equal(new_values, values):
                break
            depth, values = new_depth, new_values
        return cls(tokens=tokens, parents=parents, values=values, depth=depth, count=count, drafts=drafts)

    @classmethod
    def from_drafts(cls, drafts: list[DraftTree], prior: float = 0.6) -> DraftBatch:
        """From one `DraftTree` per row (their host lists; one tensor per field for the whole batch)."""
        hosts = [d.host() for d in drafts]
        counts = [len(h.tokens) for h in hosts]
        width = max(counts, default=0)
        scored = any(h.scores is not None for h in hosts)

        def padded(rows, fill):
            return [row + [fill] * (width - len(row)) for row in rows]

        rows = len(hosts)
        tokens = host_tensor(padded([h.tokens for h in hosts], 0), np.int64).view(rows, width)
        parents = host_tensor(padded([h.parents for h in hosts], -1), np.int64).view(rows, width)
        # Depths and capped values walked on the host lists (parents come first): what `from_tensors` settles in one
        # pass of tensor ops per level, for a few microseconds per row (the serving engine does this every step).
        depths = []
        for h in hosts:
            d: list[int] = []
            for p in h.parents:
                d.append(1 if p < 0 else d[p] + 1)
            depths.append(d)
        depth = host_tensor(padded(depths, 0), np.int64).view(rows, width)
        count = torch.tensor(counts, dtype=torch.long)
        if scored:
            # A row without scores among scored ones: its nodes at the prior by depth, like an unscored batch.
            raw = [h.scores if h.scores is not None else _prior_scores(h.parents, prior) for h in hosts]
            # Rounded to float32 and clamped first, as the tensors hold them; the caps (minima) are then exact.
            capped = host_tensor(padded(raw, 0.0), np.float32).view(rows, width).clamp(0.0, 1.0).tolist()
            for h, v in zip(hosts, capped):
                for i, p in enumerate(h.parents):
                    if p >= 0 and v[p] < v[i]:
                        v[i] = v[p]
            values = host_tensor(capped, np.float32).view(rows, width)
        else:
            valid = torch.arange(width) < count[:, None]
            values = torch.where(valid, torch.full((rows, width), prior) ** depth.float(), 0.0)
        batch = cls(tokens=tokens, parents=parents, values=values, depth=depth, count=count, drafts=list(drafts))
        batch.__dict__["_counts"] = counts
        return batch

    def take(self, rows: list[int]) -> DraftBatch:
        """The batch of rows `rows` (in that order)."""
        if rows == list(range(self.rows)):
            return self
        index = torch.tensor(rows, dtype=torch.long)
        out = DraftBatch(tokens=self.tokens[index], parents=self.parents[index], values=self.values[index],
                         depth=self.depth[index], count=self.count[index],
                         drafts=None if self.drafts is None else [self.drafts[r] for r in rows])
        out.__dict__["_counts"] = [self.counts[r] for r in rows]
        return out

    def row(self, r: int) -> DraftTree:
        """Row r's draft as a `DraftTree` (the row's own when it was drafted alone)."""
        if self.drafts is not None:
            return self.drafts[r]
        n = self.counts[r]
        return DraftTree.from_lists(self.tokens[r, :n].tolist(), self.parents[r, :n].tolist(),
                                    self.values[r, :n].tolist())

    def select(self, keep: torch.Tensor) -> DraftBatch:
        """The nodes where `keep` [R, M] is True (closed under parents), each row's in index order, parents
        remapped. Per-row drafts are trimmed too where they carry more than their tokens (`probs`, `next_probs`)."""
        keep = keep & self.valid
        position = keep.long().cumsum(1) - 1  # new index of every kept node
        count = keep.sum(1)
        width = int(count.max()) if self.rows else 0
        rows, m = self.tokens.shape
        target = torch.where(keep, position, width)  # dropped nodes go to a spare column, cut below

        def place(x, fill):
            out = torch.full((rows, width + 1), fill, dtype=x.dtype)
            return out.scatter_(1, target, x)[:, :width]

        parents = torch.where(self.parents >= 0, position.gather(1, self.parents.clamp(min=0)), -1)
        drafts = None
        if self.drafts is not None:
            keeps = keep.tolist()
            drafts = [trim_draft(d, [i for i, k in enumerate(row) if k]) for d, row in zip(self.drafts, keeps)]
        out = DraftBatch(tokens=place(self.tokens, 0), parents=place(parents, -1), values=place(self.values, 0.0),
                         depth=place(self.depth, 0), count=count, drafts=drafts)
        return out

    def verify_inputs(self, roots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tokens and parents [R, 1 + M] of the verify tree: each row's root, then its draft nodes (draft node
        j at index j + 1); padding nodes are leaves under the root (the root's token), which nobody commits."""
        root = torch.tensor(roots, dtype=torch.long).view(-1, 1)
        valid = self.valid
        tokens = torch.cat([root, torch.where(valid, self.tokens, root)], dim=1)
        parent = torch.cat([torch.full_like(root, -1), torch.where(valid & (self.parents >= 0), self.parents + 1, 0)],
                           dim=1)
        return tokens, parent


@dataclass
class DeviceDrafts:
    """Every row's draft of a batch as padded tensors on the accelerator, for a step that selects and verifies them
    without reading them back (`engine.pipeline`): a drafter that drafts all rows at once (EAGLE's batched expansion)
    makes one per step.

    Attributes (all rows of the batch, running or not; every node real):
        tokens: [R, M] int64 draft tokens in topological order.
        parents: [R, M] int64 parent among the row's nodes, -1 under the root.
        values: [R, M] float32 the drafter's estimate that each node is accepted, never above its parent's.
        depth: [R, M] int64 depth below the root (children of the root: 1).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    values: torch.Tensor
    depth: torch.Tensor


def host_tensor(rows: list, dtype) -> torch.Tensor:
    """A host tensor from (nested) Python lists of equal lengths, through NumPy (`dtype` a NumPy type; transformers
    installs NumPy, so the package adds no dependency): it parses them in about half the time `torch.tensor` takes,
    and a serving step lays out several [R, M] lists of its drafts."""
    return torch.from_numpy(np.array(rows, dtype=dtype))


def _prior_scores(parents: list[int], prior: float) -> list[float]:
    depth: list[int] = []
    for p in parents:
        depth.append(depth[p] + 1 if p >= 0 else 1)
    return [prior**d for d in depth]


def trim_draft(draft: DraftTree, keep: list[int]) -> DraftTree:
    """`draft` reduced to the nodes `keep` (sorted, closed under parents): its host lists when it carries nothing
    else, else its tensors."""
    if len(keep) == draft.num_nodes:
        return draft
    host = draft.__dict__.get("_host")
    if host is not None and draft.probs is None and draft.next_probs is None:
        remap = {old: new for new, old in enumerate(keep)}
        parents = [remap[host.parents[i]] if host.parents[i] >= 0 else -1 for i in keep]
        scores = None if host.scores is None else [host.scores[i] for i in keep]
        return DraftTree.from_lists([host.tokens[i] for i in keep], parents, scores, draft.info)
    return draft.select(torch.tensor(keep, dtype=torch.long, device=draft.tokens.device))


@dataclass
class VerifyTree:
    """The target's input for one verification forward: root + draft nodes (N = M + 1).

    Attributes:
        tokens: [B, N] int64; node 0 is the root.
        parent: [B, N] int64; parent[:, 0] = -1, draft node j sits at index j + 1.
        depth: [B, N] int64; the root has depth 0.
        ancestors: [B, N, N] bool; ancestors[b, i, j] = node j is on node i's root path (i itself included).
        draft: the DraftTree this was built from.

    `depth` and `ancestors` are worked out from `parent` on first use (on its device) and kept: the static runner
    builds its own mask inside the captured graph, so on that path nobody reads them and they are never computed.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    draft: DraftTree | None = None
    _ancestors: torch.Tensor | None = field(default=None, repr=False)
    _depth: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parent: torch.Tensor, draft: DraftTree | None = None) -> VerifyTree:
        """A forward input over any node set given by parent pointers (-1: child of the committed state)."""
        return cls(tokens=tokens, parent=parent, draft=draft)

    @property
    def ancestors(self) -> torch.Tensor:
        if self._ancestors is None:
            self._ancestors = ancestor_mask(self.parent, include_self=True)
        return self._ancestors

    @property
    def depth(self) -> torch.Tensor:
        if self._depth is None:
            self._depth = self.ancestors.sum(-1) - 1
        return self._depth

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def children(self, batch_index: int = 0) -> list[list[int]]:
        """Children of every node, in index order (Python lists; one host read of the parents, none when the draft
        was built on the host)."""
        if self.draft is not None:
            parents = [-1] + [p + 1 if p >= 0 else 0 for p in self.draft.parents[batch_index].tolist()]
        else:
            parents = self.parent[batch_index].tolist()
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(parents):
            if p >= 0:
                kids[p].append(i)
        return kids

    def token_list(self, batch_index: int = 0) -> list[int | None]:
        """Node tokens as a Python list. From a host-built draft the root's entry is None (verification never reads
        it: the root is nobody's child), which spares a device read."""
        if self.draft is not None and self.draft.tokens.device.type == "cpu":
            return [None] + self.draft.tokens[batch_index].tolist()
        return self.tokens[batch_index].tolist()

    def attention_mask(self, prefix_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive 4D mask [B, 1, N, P + N]: every node sees the committed prefix and its own root path.

        prefix_mask: [B, P] 0/1 padding mask of the committed prefix (torch.ones for no padding).
        """
        if prefix_mask is None:
            raise ValueError("prefix_mask must be given (use torch.ones for no padding)")
        b, n = self.tokens.shape
        key_valid = torch.cat([prefix_mask.bool(), torch.ones(b, n, dtype=torch.bool, device=prefix_mask.device)], 1)
        return tree_attention_mask(self.ancestors, key_valid.to(self.tokens.device), prefix_mask.shape[1], dtype)

    def position_ids(self, root_position: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """[B, N] positions: the root's position plus depth. root_position: [B].

        offsets: [R, B] for models with multimodal RoPE (rows of position ids: text, then temporal / height / width):
        then [R, B, N], row r the text position plus offsets[r] (a generated token's rows are its text position
        shifted by what the prompt's images added, as in stock decoding)."""
        positions = root_position[:, None] + self.depth
        if offsets is None:
            return positions
        return positions[None] + offsets.to(positions.device)[:, :, None]


def tree_attention_mask(ancestors: torch.Tensor, key_valid: torch.Tensor, prefix_length: int | torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [B, 1, N, L] of a verify tree whose N nodes sit in key slots prefix_length ..
    prefix_length + N - 1 of L: a committed slot (before the tree) is open where `key_valid` says (the padding mask),
    a tree slot where the node there is on the query node's root path (itself included), later slots are closed.

    Args:
        ancestors: [B, N, N] bool, [b, i, j] = node j is on node i's root path (`VerifyTree.ancestors`).
        key_valid: [B, L] or [L] bool over the key slots (only the committed ones are read).
        prefix_length: where the tree's keys start: an int, a 0-dim tensor (the static runner's, on the device), or
            a [B] tensor, one start per row (the batched static runner's: rows at different committed lengths).

    Fixed shapes and no host read: the static runner computes it inside its captured forward, the eager path with
    L = prefix_length + N.
    """
    b, n, _ = ancestors.shape
    key_length = key_valid.shape[-1]
    slots = torch.arange(key_length, device=ancestors.device)
    if isinstance(prefix_length, torch.Tensor) and prefix_length.ndim == 1:
        rel = slots[None] - prefix_length[:, None]  # [B, L]: each row's key slots relative to its own tree
        index = rel.clamp(0, n - 1)[:, None, :].expand(b, n, key_length)
        tree_part = ancestors.gather(2, index) & ((rel >= 0) & (rel < n))[:, None, :]  # [B, N, L]
    else:
        rel = slots - prefix_length  # key slot relative to the tree
        tree_part = ancestors[:, :, rel.clamp(0, n - 1)] & ((rel >= 0) & (rel < n))  # [B, N, L]
    allowed = ((rel < 0) & key_valid.view(-1, key_length))[:, None, :] | tree_part
    return additive_mask(allowed, dtype)[:, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool `allowed` (True = may attend) -> the additive mask of the same shape in `dtype` (0 or the dtype's most
    negative value), as eager and sdpa attention add it to the scores."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def build_verify_tree(root: torch.Tensor, draft: DraftTree, device: torch.device | str | None = None) -> VerifyTree:
    """Prepend the root token(s) [B] to a draft tree; the result lives on `device` (default: the root's).

    A draft built on the host (cache drafters) has its parent pointers, depths and ancestor mask worked out there
    and moved once, instead of a dozen tiny kernel launches on the accelerator.
    """
    b = root.shape[0]
    device = root.device if device is None else torch.device(device)
    tokens = torch.cat([root.view(b, 1).to(draft.tokens.device), draft.tokens], dim=1)
    par = draft.parents
    parent = torch.cat(
        [torch.full((b, 1), -1, dtype=torch.long, device=par.device), torch.where(par >= 0, par + 1, 0)], dim=1
    )
    tree = VerifyTree.from_parents(tokens, parent, draft)
    if parent.device == device:
        return tree  # depth and ancestors when first needed (the static runner never needs them)
    # Another device: work them out where the parents are (a host draft: no launches) and move them with the rest.
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return VerifyTree(tokens=move(tree.tokens), parent=move(parent), draft=draft, _ancestors=move(tree.ancestors),
                      _depth=move(tree.depth))


@dataclass
class VerifyResult:
    """Outcome of verifying one tree (batch size 1).

    Attributes:
        path: node indices from the root to the last accepted node (path[0] = 0, the root).
        tokens: [k] int64, the committed new tokens: the accepted draft tokens then the bonus token.
        score_nodes: for each new token, the node whose processed scores chose it (its parent in the path).
        token_list: the same tokens as a Python list when the verifier knows them on the host (the loop's stopping
            checks and the cache drafters read them there instead of copying `tokens` back).
    """

    path: list[int]
    tokens: torch.Tensor
    score_nodes: list[int]
    token_list: list[int] | None = None

    @classmethod
    def from_host(cls, path: list[int], tokens: list[int], device: torch.device, **fields) -> VerifyResult:
        """A result whose committed tokens the verifier chose on the host: `token_list` is `tokens`, and `tokens`
        their copy on `device`, made without waiting for the stream (a plain `torch.tensor(..., device="cuda")`
        waits for all queued work). `score_nodes` is the path: each token was chosen at the node before it."""
        on_device = torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
        return cls(path=path, tokens=on_device, score_nodes=path[:], token_list=tokens, **fields)

    @property
    def leaf(self) -> int:
        return self.path[-1]

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.path) - 1
