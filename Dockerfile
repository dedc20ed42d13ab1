# larder's container image: one static binary on an empty base.
#
# Build it with `charts/build-image.sh [TAG]`, not `docker build .`: the
# script compiles the static binary and assembles the build context this file
# expects (nothing here runs a shell, and no base image is ever pulled):
#
#   rootfs/usr/local/bin/larder        static (glibc, crt-static) binary
#   rootfs/etc/passwd, rootfs/etc/group  root and larder (65532:65532)
#   rootfs/etc/nsswitch.conf           "hosts: files dns" (Docker and
#                                      Kubernetes mount /etc/hosts and
#                                      /etc/resolv.conf, not this file)
#   rootfs/etc/larder/larder.toml      config/default.toml, cache in /var/lib/larder
#   rootfs/tmp/                        mode 1777
#   cache/                             empty: becomes /var/lib/larder
#
# No CA bundle: larder trusts compiled-in web PKI roots (plus an upstream's
# `ca_file`, which you mount).
#
# Run it with a volume for the cache and your own config, for example:
#   docker run -p 5000:5000 -p 9090:9090 -v larder-cache:/var/lib/larder \
#     -v $PWD/larder.toml:/etc/larder/larder.toml:ro larder:dev
FROM scratch

ARG VERSION=dev
ARG REVISION=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="larder" \
      org.opencontainers.image.description="A pull-through caching proxy for OCI/Docker container registries" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}"

# Binary, config and accounts belong to root: the runtime user cannot
# change them.
COPY rootfs/ /
# The cache: the only place larder writes (blobs, index.redb, tmp/).
COPY --chown=65532:65532 cache/ /var/lib/larder/

USER 65532:65532
# Registry API (server.listen) and metrics/health (server.admin_listen).
EXPOSE 5000 9090
# larder is PID 1: it handles SIGTERM itself (drains for up to
# server.shutdown_grace, then exits 0).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/larder"]
CMD ["--config", "/etc/larder/larder.toml"]
