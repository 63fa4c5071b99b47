"""Forest bookkeeping: node layout, root-to-leaf paths, owning positions, ancestor mask."""

from __future__ import annotations

import random

import torch

from vllm_dsbd.algorithm import ancestor_mask, build_forest, gather_node_rows, root_to_leaf_paths
from vllm_dsbd.algorithm.toy import random_markov


def _docstring_example():
    return build_forest(2, torch.tensor([[0, 0], [1, 1]]), torch.tensor([[5, 7], [3, 4]]),
                        torch.ones(2, 2, dtype=torch.bool))


def test_worked_example_from_the_docstring():
    """The forest.py docstring's example, value by value."""
    forest = _docstring_example()
    assert forest.parents.tolist() == [-1, -1, 0, 0, 3, 3]
    assert forest.depths.tolist() == [0, 0, 1, 1, 2, 2]
    paths = root_to_leaf_paths(forest)
    assert paths.path_nodes.tolist() == [0, 2, 0, 3, 4, 0, 3, 5, 1]
    assert paths.cu_num_positions.tolist() == [0, 2, 5, 8, 9]
    assert paths.num_shared.tolist() == [0, 1, 2, 0]
    assert paths.node_position.tolist() == [0, 8, 1, 3, 4, 7]


def test_absent_slots_are_not_in_any_path():
    """A slot the draft left empty gets no position; its parent becomes a leaf."""
    forest = build_forest(1, torch.tensor([[0, 0], [0, 1]]), torch.tensor([[1, 2], [3, 4]]),
                          torch.tensor([[True, True], [False, False]]))
    paths = root_to_leaf_paths(forest)
    assert paths.path_nodes.tolist() == [0, 1, 0, 2]
    assert paths.node_position.tolist() == [0, 1, 3, -1, -1]


def test_ancestor_mask_of_worked_example():
    """Each node sees itself and its ancestors, never siblings or other roots' nodes."""
    mask = ancestor_mask(_docstring_example())
    seen = [sorted(torch.nonzero(row)[:, 0].tolist()) for row in mask]
    assert seen == [[0], [1], [0, 2], [0, 3], [0, 3, 4], [0, 3, 5]]


def test_paths_of_random_forests_recover_every_node_distribution():
    """Target rows gathered from path positions equal the target evaluated on each node's own sequence."""
    rng = random.Random(0)
    model = random_markov(6, order=2, seed=0)
    for _ in range(30):
        roots, width, gamma = rng.randint(1, 3), rng.randint(1, 4), rng.randint(0, 3)
        parents = [[rng.randrange(roots if i == 0 else width) for _ in range(width)] for i in range(gamma)]
        tokens = torch.randint(0, 6, (gamma, width), generator=torch.Generator().manual_seed(rng.randrange(999)))
        exists = torch.tensor([[rng.random() < 0.8 for _ in range(width)] for _ in range(gamma)],
                              dtype=torch.bool).reshape(gamma, width)
        for i in range(1, gamma):  # a node whose parent slot is empty cannot exist
            exists[i] &= exists[i - 1][torch.tensor(parents[i])]
        forest = build_forest(roots, torch.tensor(parents, dtype=torch.long).reshape(gamma, width), tokens, exists)
        root_seqs = [[rng.randrange(6) for _ in range(rng.randint(1, 3))] for _ in range(roots)]

        def sequence(node: int) -> list[int]:
            chain = []
            while forest.parents[node] >= 0:
                chain.append(int(forest.tokens[node]))
                node = int(forest.parents[node])
            return root_seqs[node] + chain[::-1]

        paths = root_to_leaf_paths(forest)
        cu = paths.cu_num_positions.tolist()
        nodes = paths.path_nodes.tolist()
        for k in range(paths.num_paths):
            path = nodes[cu[k]:cu[k + 1]]
            assert forest.parents[path[0]] == -1 and all(forest.parents[b] == a for a, b in zip(path, path[1:]))
            if k:
                prev = nodes[cu[k - 1]:cu[k]]
                common = next((i for i, (a, b) in enumerate(zip(path, prev)) if a != b), min(len(path), len(prev)))
                assert paths.num_shared[k] == common
        present = forest.exists.nonzero()[:, 0].tolist()
        assert sorted(set(nodes)) == present
        position_rows = model([sequence(n) for n in nodes])
        node_rows = gather_node_rows(position_rows, paths)
        for n in present:
            assert torch.equal(node_rows[n], model([sequence(n)])[0])


def test_padded_roots_give_verify_forest_layout():
    """With W padded roots, gathered node rows reshape to verify_forest's [γ+1, W, V] layout."""
    model = random_markov(5, order=1, seed=2)
    roots = [[1], [3], None]  # W = 3 slots, two input beams
    parents = torch.tensor([[0, 1, 1], [2, 0, 0]])
    tokens = torch.tensor([[4, 0, 2], [1, 3, 4]])
    forest = build_forest(3, parents, tokens, torch.ones(2, 3, dtype=torch.bool),
                          root_exists=torch.tensor([True, True, False]))
    paths = root_to_leaf_paths(forest)

    def sequence(node: int) -> list[int]:
        chain = []
        while forest.parents[node] >= 0:
            chain.append(int(forest.tokens[node]))
            node = int(forest.parents[node])
        return roots[node] + chain[::-1]

    layout = gather_node_rows(model([sequence(n) for n in paths.path_nodes.tolist()]), paths).reshape(3, 3, 5)
    assert torch.equal(layout[0, :2], model([[1], [3]]))
    assert torch.equal(layout[0, 2], torch.zeros(5))  # padding root
    assert torch.equal(layout[2, 0], model([[3, 2, 1]])[0])  # layer 2 slot 0: parent = layer-1 slot 2 (root 1, token 2)
