"""Batched image operations in torch: grey, Gaussian blur, Sobel edges, histogram equalisation.

All take and return float tensors ``(N, C, H, W)`` with values in ``[0, 1]``
and work on any device. Borders replicate the edge pixel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from freeride.sidetasks._common import sample_seed

__all__ = ["edge_pipeline", "equalize_hist", "gaussian_blur", "gaussian_kernel", "sobel", "synthetic_scene", "to_gray"]

_LUMA = (0.299, 0.587, 0.114)
_SOBEL_MAX = 4.0 * math.sqrt(2.0)  # largest gradient magnitude of an image in [0, 1]


def to_gray(x: torch.Tensor) -> torch.Tensor:
    """ITU-R BT.601 luma of RGB images (grey images pass through): ``(N, 1, H, W)``."""
    if x.shape[1] == 1:
        return x
    if x.shape[1] != 3:
        raise ValueError(f"need 1 or 3 channels, got {x.shape[1]}")
    w = torch.tensor(_LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x * w).sum(1, keepdim=True)


def gaussian_kernel(sigma: float) -> torch.Tensor:
    """Normalised 1-D Gaussian taps, radius ``ceil(3 * sigma)``, float32."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    radius = math.ceil(3.0 * sigma)
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-(t * t) / (2.0 * sigma * sigma))
    return (k / k.sum()).to(torch.float32)


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of every channel (borders replicated)."""
    k = gaussian_kernel(sigma).to(x.device, x.dtype)
    r = (len(k) - 1) // 2
    n, c, h, w = x.shape
    y = x.reshape(n * c, 1, h, w)
    y = F.conv2d(F.pad(y, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    y = F.conv2d(F.pad(y, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1))
    return y.reshape(n, c, h, w)


def sobel(x: torch.Tensor) -> torch.Tensor:
    """Sobel gradient magnitude of the luma, scaled into ``[0, 1]``: ``(N, 1, H, W)``."""
    g = F.pad(to_gray(x), (1, 1, 1, 1), mode="replicate")
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], dtype=x.dtype, device=x.device)
    kernels = torch.stack([kx, kx.t()]).unsqueeze(1)  # d/dx, d/dy as cross-correlations
    grad = F.conv2d(g, kernels)
    return grad.square().sum(1, keepdim=True).sqrt() / _SOBEL_MAX


def equalize_hist(x: torch.Tensor, bins: int = 256) -> torch.Tensor:
    """Histogram equalisation of each image's luma over ``bins`` levels.

    A pixel at level ``v`` maps to ``(cdf(v) - cdf_min) / (count - cdf_min)``
    where ``cdf`` counts pixels at levels ``<= v`` and ``cdf_min`` is the
    count at the darkest level present. A flat image maps to zeros.
    """
    g = to_gray(x)
    n = g.shape[0]
    levels = (g.reshape(n, -1) * (bins - 1)).round().clamp(0, bins - 1).long()
    offsets = torch.arange(n, device=x.device).unsqueeze(1) * bins
    hist = torch.bincount((levels + offsets).reshape(-1), minlength=n * bins).view(n, bins)
    cdf = hist.cumsum(1)
    count = levels.shape[1]
    cdf_min = cdf.gather(1, levels.min(1, keepdim=True).values)
    denom = (count - cdf_min).clamp(min=1).to(x.dtype)
    out = (cdf.gather(1, levels) - cdf_min).to(x.dtype) / denom
    return out.view_as(g)


def edge_pipeline(x: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equalise, blur, then find edges.

    Returns:
        ``(equalised, blurred, edges)``, each ``(N, 1, H, W)``.
    """
    eq = equalize_hist(x)
    blurred = gaussian_blur(eq, sigma)
    return eq, blurred, sobel(blurred)


def synthetic_scene(index: int, size: int, *, seed: int) -> torch.Tensor:
    """A reproducible RGB test image ``(3, size, size)``: gradient, rectangles, a disc, noise.

    Low contrast on purpose (values in about ``[0.25, 0.75]``), so that
    equalisation has something to do.
    """
    g = torch.Generator().manual_seed(sample_seed(seed, -6, index))
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    direction = torch.rand(2, generator=g)
    img = (0.3 + 0.2 * (direction[0] * xx + direction[1] * yy)).expand(3, size, size).clone()
    for _ in range(3):
        y0, x0 = (torch.rand(2, generator=g) * 0.8).tolist()
        h, w = (0.1 + torch.rand(2, generator=g) * 0.4).tolist()
        mask = (yy >= y0) & (yy < y0 + h) & (xx >= x0) & (xx < x0 + w)
        img[:, mask] = (0.25 + 0.5 * torch.rand(3, 1, generator=g)).expand(3, int(mask.sum()))
    cy, cx, rad = (torch.rand(3, generator=g) * torch.tensor([1.0, 1.0, 0.3])).tolist()
    disc = (yy - cy).square() + (xx - cx).square() < rad * rad
    img[:, disc] = (0.25 + 0.5 * torch.rand(3, 1, generator=g)).expand(3, int(disc.sum()))
    img += 0.02 * torch.randn(3, size, size, generator=g)
    return img.clamp(0.0, 1.0)
