#!/usr/bin/env bash
# The base images compose.yaml and the Dockerfile name, built here where no image registry is
# reachable: docker.io/library/python:3.11-slim and docker.io/library/redis:7 as stand-ins
# from Debian 12 (python3.11, redis-server 7.0), on a minimal Debian made by mmdebstrap.
# An image that exists already (built before, or pulled from a registry) is kept.
#
#   CONTAINERS_CONF=deploy/podman/containers.conf deploy/podman/base-images.sh [--rebuild]
#
# Needs root (mmdebstrap writes the root file system), podman and mmdebstrap: `make podman`
# installs them on Debian. The base carries the host's CA certificates
# (/usr/local/share/ca-certificates), so pip in a build trusts what the host trusts (a proxy
# that intercepts TLS included).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
base=localhost/datagen-debian:bookworm
python=docker.io/library/python:3.11-slim
redis=docker.io/library/redis:7
suite="${DEBIAN_SUITE:-bookworm}"

rebuild=0
case "${1:-}" in
  --rebuild) rebuild=1 ;;
  "") ;;
  *) echo "usage: $0 [--rebuild]" >&2; exit 2 ;;
esac
for tool in podman mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "$0: no $tool on the PATH (make podman)" >&2; exit 1; }
done

wanted() {  # true when image $1 must be (re)built
  [ "$rebuild" = 1 ] || ! podman image exists "$1"
}

if wanted "$python" || wanted "$redis"; then
  if wanted "$base"; then
    echo "building $base with mmdebstrap ($suite, minbase)"
    extra=()
    if [ -d /usr/local/share/ca-certificates ]; then
      extra+=(--customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share')
    fi
    mmdebstrap --quiet --variant=minbase --include=ca-certificates "${extra[@]}" \
      --customize-hook='chroot "$1" update-ca-certificates' "$suite" - \
      | podman import --quiet - "$base" >/dev/null
  fi
  for name in python redis; do
    image="${!name}"
    if wanted "$image"; then
      echo "building $image (stand-in: $name.Containerfile)"
      podman build --quiet --network host -f "$here/$name.Containerfile" -t "$image" "$here" \
        >/dev/null
    fi
  done
fi
podman image exists "$python" && podman image exists "$redis"
