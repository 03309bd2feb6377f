"""Keep only the accepted path of a verified tree in the target's KV cache."""

import torch


def keep_accepted_path(cache, past_length: int, path: list[int], num_nodes: int) -> None:
    """After a tree forward appended `num_nodes` entries behind `past_length`, keep only the nodes of `path`.

    A chain's accepted path is a prefix and only needs a crop; a tree's path is moved in place first, so RoPE stays
    right: a node at depth d was written at position past + d, exactly its position on the linear path.
    """
    if list(path) != list(range(len(path))):
        src = torch.tensor(path, device=cache.layers[0].keys.device) + past_length
        dst = torch.arange(len(path), device=src.device) + past_length
        for layer in cache.layers:
            layer.keys[..., dst, :] = layer.keys[..., src, :]
            layer.values[..., dst, :] = layer.values[..., src, :]
    dropped = num_nodes - len(path)
    if dropped:
        cache.crop(-dropped)
