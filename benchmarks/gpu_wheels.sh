#!/usr/bin/env bash
# Wheels for the GPU machine (docs/gpu.md, "Running on a GPU"): it has Python 3.12, torch,
# numpy, ml_dtypes and rich, no package index, and not the format's other dependencies.
# Downloads them, at the versions this checkout's .venv holds, into .whl/ (ignored by git
# through .git/info/exclude); a device run then carries .whl and gpu_run.sh installs it.
#
#   bash benchmarks/gpu_wheels.sh     # then: run(command="OUT=$OUT bash benchmarks/gpu_run.sh",
#                                     #           carry=[".whl"])
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
pins=()
for name in zarr donfig numcodecs google-crc32c jsonschema jsonschema-specifications \
        referencing rpds-py jsonschema-rs crc32c; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    pins+=("$name==$version")
done
platforms=()
for n in 5 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls .whl
