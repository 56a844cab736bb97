#!/usr/bin/env bash
# Build the router image on a machine that cannot pull public images, then check that it answers.
#
#   bash deploy/image/build.sh [--check] [--rebuild-base]
#
# 1. A Debian 12 (bookworm) base from Debian's own packages (mmdebstrap: python3, python3-venv,
#    libibverbs1, ca-certificates), imported into podman as $SMETRIC_BASE_IMAGE
#    (default localhost/smetric/debian-base:bookworm). Made once; --rebuild-base makes it again.
# 2. deploy/image/Containerfile on that base with `podman build --isolation chroot` (no user
#    namespaces or overlay mounts needed): a venv filled from requirements/project.lock.txt,
#    tagged $SMETRIC_IMAGE (default localhost/smetric/stack:latest). The host's CA bundle is
#    mounted for pip (a TLS-inspecting proxy's CA is in it), PIP_CERT pointing at it.
# 3. --check: deploy/image/check.py starts an emulated stack inside the image
#    (`buildah run --isolation chroot`, which shares this machine's network) and asks its router
#    for a chat completion from outside (`podman run` fails on rlimits on some sandboxes).
#
# Needs root (or a podman set up for rootless chroot builds) and the Debian packages mmdebstrap,
# podman and buildah (`apt-get install mmdebstrap podman buildah`). On a normal machine with
# docker, no base is needed: `docker build -f deploy/image/Containerfile -t smetric/stack .`
# (docs/deploy/kubernetes.md, "The router image").
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${SMETRIC_BASE_IMAGE:-localhost/smetric/debian-base:bookworm}
TAG=${SMETRIC_IMAGE:-localhost/smetric/stack:latest}
SUITE=${SMETRIC_DEBIAN_SUITE:-bookworm}
CA=${SMETRIC_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
check=0
rebuild=0
for a in "$@"; do
  case "$a" in
    --check) check=1 ;;
    --rebuild-base) rebuild=1 ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown option $a (see --help)" >&2; exit 2 ;;
  esac
done
for tool in mmdebstrap podman buildah; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is not installed (apt-get install mmdebstrap podman buildah)" >&2; exit 1; }
done

t0=$(date +%s)
if [ "$rebuild" = 1 ] || ! podman image exists "$BASE"; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "build.sh: base $BASE from Debian $SUITE (mmdebstrap)"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,libibverbs1,ca-certificates \
    "$SUITE" "$tmp/base.tar"
  podman import --quiet --change 'CMD ["/bin/bash"]' "$tmp/base.tar" "$BASE" >/dev/null
  echo "build.sh: base made in $(($(date +%s) - t0)) s"
fi

t1=$(date +%s)
extra=()
if [ -f "$CA" ]; then
  extra=(--volume "$(dirname "$CA"):/host-ca:ro" --build-arg "PIP_CERT=/host-ca/$(basename "$CA")")
fi
podman build --isolation chroot --build-arg "BASE=$BASE" "${extra[@]}" \
  -f deploy/image/Containerfile -t "$TAG" .
echo "build.sh: $TAG built in $(($(date +%s) - t1)) s ($(podman image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"

if [ "$check" = 1 ]; then
  "${PYTHON:-python3}" deploy/image/check.py "$TAG"
fi
echo "build.sh: done in $(($(date +%s) - t0)) s"
