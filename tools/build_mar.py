"""Package the handler, the modules beside it (and the C++ kernels they build) and (optionally) a checkpoint into llama.mar.

    python tools/build_mar.py --config build/model-config.yaml --weights demo --export-path model_store
A checkpoint given with --weights is copied into the archive as weights/; without it, the
config's handler.checkpoint must be an absolute path (a large checkpoint served in place).
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_mar(config: str, export_path: str, weights: str | None = None, name: str = "llama",
              root: str = ROOT, handler: str | None = None, modules: tuple = ()) -> str:
    """root: the source tree whose handler.py and modules go in (another checkout, for a
    benchmark's baseline). handler: another handler file instead of root's handler.py (the
    tests' subclass, which imports it), with more modules of its own."""
    os.makedirs(export_path, exist_ok=True)
    handler = handler or os.path.join(root, "handler.py")
    with tempfile.TemporaryDirectory() as stage:
        sources = glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*.cpp"))  # the kernels build on first use
        extra = [p for p in sorted(sources) + list(modules) if p != handler]
        if weights:  # a folder's contents land in the archive's root: stage it as weights/
            shutil.copytree(weights, os.path.join(stage, "weights"))
            extra.append(stage)
        archiver = os.path.join(os.path.dirname(sys.executable), "torch-model-archiver")
        # the archiver stages its files in $TMPDIR/<name>: a private TMPDIR keeps builds apart.
        # zip-store: a zip without compression. Weights barely deflate (the demo's 17 MB to
        # 13.7), and deflating them took 1.1 s of the archive's 1.2 (0.1 s stored).
        subprocess.run([archiver, "--model-name", name, "--version", "1.0",
                        "--handler", handler, "--extra-files", ",".join(extra), "--archive-format", "zip-store",
                        "--config-file", config, "--export-path", export_path, "--force"], check=True,
                       env=dict(os.environ, TMPDIR=stage))
    return os.path.join(export_path, f"{name}.mar")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--export-path", required=True)
    ap.add_argument("--weights")
    a = ap.parse_args()
    print(build_mar(a.config, a.export_path, a.weights))


if __name__ == "__main__":
    main()
