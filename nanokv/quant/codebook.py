"""Non-uniform codebooks (KVQuant's nuq): Fisher-weighted 1-D k-means on normalised values.

Objective: minimise sum_i F_i (x_i - c(x_i))^2 over centroids c, with x_i in [-1, 1] the
normalised activations and F_i = (dL/dA_i)^2 their Fisher information (squared gradient of the
LM loss). Deterministic: initial centroids are the weighted quantiles at (j + 0.5) / k, samples
beyond `max_samples` are subsampled with a seeded generator, Lloyd iterations (default 50,
stopping early when nothing moves). A cluster that ends up empty keeps its previous centroid.
"""

from __future__ import annotations

import torch


def weighted_quantiles(values: torch.Tensor, weights: torch.Tensor,
                       probs: torch.Tensor) -> torch.Tensor:
    order = values.argsort()
    v, w = values[order], weights[order].double()
    cdf = w.cumsum(0)
    cdf = cdf / cdf[-1]
    idx = torch.searchsorted(cdf, probs.double().contiguous()).clamp_(max=v.numel() - 1)
    return v[idx]


def fisher_kmeans(values: torch.Tensor, weights: torch.Tensor | None, num_centroids: int,
                  iters: int = 50, max_samples: int = 1_000_000, seed: int = 0) -> torch.Tensor:
    """values [N] in [-1, 1], weights [N] >= 0 (None = uniform) -> sorted centroids [k]."""
    if num_centroids < 2:
        raise ValueError(f"num_centroids must be >= 2, got {num_centroids}")
    values = values.detach().flatten().float().cpu()
    if values.numel() == 0:
        raise ValueError("no values to learn a codebook from")
    weights = (torch.ones_like(values) if weights is None
               else weights.detach().flatten().float().cpu())
    if weights.shape != values.shape or bool((weights < 0).any()):
        raise ValueError("weights must be >= 0 and match values")
    if values.numel() > max_samples:
        gen = torch.Generator().manual_seed(seed)
        pick = torch.randperm(values.numel(), generator=gen)[:max_samples]
        values, weights = values[pick], weights[pick]
    values = values.clamp(-1.0, 1.0)
    total = weights.sum()
    if not torch.isfinite(total) or total <= 0:
        weights = torch.ones_like(values)
    else:
        # tiny floor: an element with zero Fisher weight still breaks ties between clusters
        weights = weights / weights.mean() + 1e-6
    probs = (torch.arange(num_centroids, dtype=torch.float64) + 0.5) / num_centroids
    centroids = weighted_quantiles(values, weights, probs).double()
    centroids, _ = centroids.sort()
    xd, wd = values.double(), weights.double()
    for _ in range(iters):
        mids = (centroids[1:] + centroids[:-1]) / 2
        assign = torch.bucketize(xd, mids)
        num = torch.zeros(num_centroids, dtype=torch.float64).scatter_add_(0, assign, wd * xd)
        den = torch.zeros(num_centroids, dtype=torch.float64).scatter_add_(0, assign, wd)
        new = torch.where(den > 0, num / den.clamp_min(1e-300), centroids)
        new, _ = new.sort()
        if torch.equal(new, centroids):
            break
        centroids = new
    return centroids.clamp(-1.0, 1.0).float()
