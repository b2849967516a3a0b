# Multi-stage build: a static kvproxy binary on a distroless, non-root base.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/kvproxy ./cmd/kvproxy \
 && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/kvmock ./cmd/kvmock

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/kvproxy /out/kvmock /usr/local/bin/
COPY config.example.yaml /etc/kvproxy/config.yaml
USER nonroot:nonroot
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/kvproxy"]
CMD ["-config", "/etc/kvproxy/config.yaml", "-listen", "0.0.0.0:8080"]
