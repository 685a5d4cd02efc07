"""Tiny PNG encoding (zlib + struct, no imaging library) for report thumbnails."""

from __future__ import annotations

import base64
import struct
import zlib

import torch
from torch import Tensor

__all__ = ["png_bytes", "png_data_uri"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def png_bytes(image: Tensor) -> bytes:
    """An 8-bit PNG of ``image`` ``[H, W]`` (grey) or ``[H, W, 3]`` (RGB), scaled to its range.

    Non-finite values are drawn as 0; a constant image is drawn black.
    """
    pixels = torch.nan_to_num(image.detach().double().cpu(), nan=0.0, posinf=0.0, neginf=0.0)
    low, high = float(pixels.min()), float(pixels.max())
    scaled = (pixels - low) / (high - low) if high > low else torch.zeros_like(pixels)
    data = (scaled * 255).round().to(torch.uint8)
    height, width = data.shape[:2]
    colour = 2 if data.dim() == 3 else 0
    rows = b"".join(b"\x00" + data[y].contiguous().numpy().tobytes() for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows, 9)) + _chunk(b"IEND", b""))


def png_data_uri(image: Tensor) -> str:
    """``data:image/png;base64,...`` of :func:`png_bytes`."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode("ascii")
