// Command stargz-serve serves stargz-snapshotter's snapshotter (the
// library's service.NewStargzSnapshotterService, the call
// containerd-stargz-grpc makes, with its default configuration) on a unix
// socket as a containerd proxy plugin. The bench builds it because the
// command's own Go module is not published on the module proxy.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/log"
	"github.com/containerd/stargz-snapshotter/service"
	"google.golang.org/grpc"
)

func main() {
	address := flag.String("address", "", "unix socket to serve the snapshots API on")
	root := flag.String("root", "", "the snapshotter's state directory")
	level := flag.String("log-level", "info", "log level (debug, info, warn, error)")
	flag.Parse()
	if *address == "" || *root == "" {
		fmt.Fprintln(os.Stderr, "usage: stargz-serve -address SOCKET -root DIR")
		os.Exit(2)
	}
	if err := log.SetLevel(*level); err != nil {
		fail("log level", err)
	}
	ctx := log.WithLogger(context.Background(), log.L)
	if err := os.MkdirAll(*root, 0o700); err != nil {
		fail("root", err)
	}
	if err := service.Supported(*root); err != nil {
		fail("not supported here", err)
	}
	var cfg service.Config
	sn, err := service.NewStargzSnapshotterService(ctx, *root, &cfg)
	if err != nil {
		fail("snapshotter", err)
	}
	srv := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(srv, snapshotservice.FromSnapshotter(sn))
	_ = os.Remove(*address)
	if err := os.MkdirAll(filepath.Dir(*address), 0o700); err != nil {
		fail("socket directory", err)
	}
	l, err := net.Listen("unix", *address)
	if err != nil {
		fail("listen", err)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-stop
		srv.Stop()
	}()
	if err := srv.Serve(l); err != nil {
		log.G(ctx).WithError(err).Error("serve")
	}
	// Unmounts every layer it mounted.
	if err := sn.Close(); err != nil {
		log.G(ctx).WithError(err).Warn("close")
	}
}

func fail(what string, err error) {
	fmt.Fprintf(os.Stderr, "stargz-serve: %s: %v\n", what, err)
	os.Exit(1)
}
