package main

import (
	"context"
	"fmt"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"google.golang.org/grpc"
)

// setupTracing exports a span per gRPC call over OTLP/gRPC to endpoint
// (host:port, or a URL such as http://collector:4317). It returns the
// server option that instruments calls and a function that flushes and
// stops the exporter. With no endpoint it returns no option: tracing then
// costs nothing.
func setupTracing(ctx context.Context, endpoint string) (grpc.ServerOption, func(context.Context) error, error) {
	if endpoint == "" {
		return nil, func(context.Context) error { return nil }, nil
	}
	opts := []otlptracegrpc.Option{}
	switch {
	case strings.HasPrefix(endpoint, "http://"):
		opts = append(opts, otlptracegrpc.WithEndpoint(strings.TrimPrefix(endpoint, "http://")), otlptracegrpc.WithInsecure())
	case strings.HasPrefix(endpoint, "https://"):
		opts = append(opts, otlptracegrpc.WithEndpoint(strings.TrimPrefix(endpoint, "https://")))
	default:
		opts = append(opts, otlptracegrpc.WithEndpoint(endpoint), otlptracegrpc.WithInsecure())
	}
	exp, err := otlptracegrpc.New(ctx, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("--otlp-endpoint %s: %w", endpoint, err)
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName("idemcoord"))),
	)
	handler := otelgrpc.NewServerHandler(
		otelgrpc.WithTracerProvider(tp),
		otelgrpc.WithPropagators(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
	)
	return grpc.StatsHandler(handler), tp.Shutdown, nil
}
