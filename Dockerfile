# topolb image: topolb-agent (the DaemonSet's entry point) and topolbctl.
#
#   make image                      # docker build -t topolb:dev .
#   docker build --build-arg VERSION=v0.1.0 -t ghcr.io/topolb/topolb:v0.1.0 .
#
# A thin wrapper around `make build`: static Go binaries, no C toolchain
# (the generated BPF objects and their Go bindings are committed).

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
ENV CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false"
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN make build && ./bin/topolb-agent --help >/dev/null

# distroless/static: CA certificates and tzdata, no shell, no package manager.
FROM gcr.io/distroless/static-debian12
ARG VERSION=dev
LABEL org.opencontainers.image.source="https://github.com/topolb/topolb" \
      org.opencontainers.image.title="topolb" \
      org.opencontainers.image.description="Node-local eBPF load balancer for Kubernetes Services that honors topology" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /src/bin/topolb-agent /src/bin/topolbctl /usr/local/bin/
# uid 0, but not privileged: the DaemonSet drops every capability and adds
# back only BPF, NET_ADMIN and PERFMON (deploy/daemonset.yaml). The pins
# under /sys/fs/bpf belong to root.
USER 0:0
ENTRYPOINT ["/usr/local/bin/topolb-agent"]
