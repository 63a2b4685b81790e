"""Image files (PNG, JPEG, WebP, BMP, TIFF, GIF), decoded one file at a time, every frame, strictly.

A record is an image file; its identifier is the file and the sha256 of its bytes. A file that does not decode is
`corrupt_image`; images are compared by mode and size, and the pixels of floating ("F" mode) images are scanned.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from nanscan.data.checker import Checker, file_ref
from nanscan.data.findings import CORRUPT_IMAGE


def _decode_image(path: Path) -> dict:
    """Fully decode one image file (every frame). The file's digest is taken later, and only for the files that a
    finding or a sample names."""
    from PIL import Image

    out: dict = {"error": None, "size": 0}
    try:
        out["size"] = os.stat(path).st_size
    except OSError as exc:
        out["error"] = f"cannot read the file ({exc})"
        return out
    if out["size"] == 0:
        out["error"] = "zero bytes"
        return out
    try:
        with Image.open(path) as im:
            out["mode"], out["height"], out["width"] = im.mode, im.height, im.width
            for frame in range(getattr(im, "n_frames", 1)):
                if frame:
                    im.seek(frame)
                im.load()
                if frame == 0 and im.mode == "F":
                    out["pixels"] = np.asarray(im)
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for broken files
        out["error"] = f"cannot be decoded ({type(exc).__name__}: {exc})"
    return out


class Images:
    """Decodes images one by one, strictly: within it a truncated image fails to decode (Pillow must never pad it
    silently), and Pillow's warnings (e.g. DecompressionBombWarning: size alone is not a defect) are not printed
    per file. `scope` is the checker scope its images are tallied in (one per path given to the check), whatever
    scope the other files of a folder set meanwhile.

    One loop in this process: decoding small images is mostly Python work inside Pillow, and on the 2-core dev
    machine neither threads nor a process pool beat it (measured with 64-128 px PNG/JPEG files).
    """

    def __init__(self, checker: Checker, scope: tuple[str, str]):
        self.checker = checker
        self.scope = scope

    def __enter__(self):
        from PIL import ImageFile

        self._strict = ImageFile.LOAD_TRUNCATED_IMAGES
        ImageFile.LOAD_TRUNCATED_IMAGES = False
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", module=r"PIL\.")  # Pillow's own warnings only; a broken file is a finding
        return self

    def __exit__(self, *exc):
        from PIL import ImageFile

        self._warnings.__exit__(*exc)
        ImageFile.LOAD_TRUNCATED_IMAGES = self._strict
        return False

    def add(self, path: Path) -> None:
        result = _decode_image(path)
        scope, self.checker.scope = self.checker.scope, self.scope
        try:
            self._record(path, result)
        finally:
            self.checker.scope = scope

    def _record(self, path: Path, result: dict) -> None:
        checker = self.checker
        checker.files += 1
        checker.bytes += result["size"]
        checker.records += 1
        checker.progress.advance(result["size"])
        ref = file_ref(path)
        if result["error"]:
            checker.sink.add(CORRUPT_IMAGE, ref, result["error"], "image")
            return
        checker.tracker.add("image", f"image[{result['mode']}]", (result["height"], result["width"]), ref)
        if "pixels" in result:
            checker.numbers.add_array(ref, "image", result["pixels"])
