#!/usr/bin/env bash
# build-image.sh builds the OCI image idemcoord:$VERSION with buildah
# (`make image`): a static binary (CGO_ENABLED=0) with the version and commit
# set by -ldflags, the host's CA bundle and a passwd entry for UID 65532, on
# top of nothing (deploy/image/Containerfile starts FROM scratch, so no
# registry is needed). The image stays in buildah's local storage.
#
# Environment:
#   VERSION, COMMIT    required: the image tag and the commit it is built from
#   BUILDAH_FLAGS      global buildah flags (default: --storage-driver vfs,
#                      which works without overlay support, in containers too)
#   CA_CERTIFICATES    the CA bundle to copy (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

cd "$(dirname "$0")/.."
version=${VERSION:?set VERSION}
commit=${COMMIT:?set COMMIT}
read -r -a flags <<<"${BUILDAH_FLAGS---storage-driver vfs}"
ca=${CA_CERTIFICATES:-/etc/ssl/certs/ca-certificates.crt}

command -v buildah >/dev/null || { echo "build-image: no buildah on PATH (Debian: apt-get install buildah)" >&2; exit 1; }
[[ -s $ca ]] || { echo "build-image: no CA bundle at $ca (Debian: apt-get install ca-certificates)" >&2; exit 1; }

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT

CGO_ENABLED=0 GOOS=linux go build -trimpath \
	-ldflags "-s -w -X main.version=$version -X main.commit=$commit" \
	-o "$ctx/idemcoord" ./cmd/idemcoord
cp deploy/image/passwd deploy/image/group "$ctx/"
cp "$ca" "$ctx/ca-certificates.crt"

# The commit's time stamps the image, its files and its label, so building
# the same commit again gives the same image.
epoch=$(git log -1 --format=%ct 2>/dev/null || date +%s)
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)

set -x
buildah "${flags[@]}" bud --isolation chroot --timestamp "$epoch" \
	--build-arg "VERSION=$version" --build-arg "COMMIT=$commit" --build-arg "CREATED=$created" \
	-f deploy/image/Containerfile -t "idemcoord:$version" "$ctx"
