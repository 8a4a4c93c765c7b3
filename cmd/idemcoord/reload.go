package main

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/idemcoord/idemcoord/server"
)

// reloadDebounce collapses the burst of file events one save makes.
const reloadDebounce = 250 * time.Millisecond

// notifyHangup starts catching SIGHUP (which would otherwise end the
// process) as early as possible.
func notifyHangup() chan os.Signal {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	return hup
}

// reloadCheck is the check every reload of the config file passes besides
// server.Server.Reload's own: the start-up exposure checks of the
// listeners, on the new file's tenants.
func reloadCheck(c *config) func(*server.Policies) error {
	return func(p *server.Policies) error {
		return errors.Join(checkExposure(c, p.AuthEnabled()), checkConsoleExposure(c, p.AuthEnabled()))
	}
}

// watchConfig reloads the policy file at path on SIGHUP and whenever the
// file changes, until ctx ends, through server.Server.Reload: a file that
// fails to load or validate, is empty, or would turn auth on or off is
// refused with a logged reason (and counted), and the configuration in
// force stays. check (the start-up exposure check) runs on every reload.
// Without a path, SIGHUP is logged and ignored.
func watchConfig(ctx context.Context, logger *slog.Logger, path string, hup <-chan os.Signal, srv *server.Server, check func(*server.Policies) error) {
	if path == "" {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				logger.Info("SIGHUP ignored: no --config file to reload")
			}
		}
	}

	// Watch the directory, not the file: editors and config-map updates
	// replace files by renaming, which a watch on the old inode misses.
	var events <-chan fsnotify.Event
	var watchErrs <-chan error
	if w, err := fsnotify.NewWatcher(); err != nil {
		logger.Warn("cannot watch the config file for changes; reload with SIGHUP", "err", err)
	} else {
		defer w.Close()
		if err := w.Add(filepath.Dir(path)); err != nil {
			logger.Warn("cannot watch the config file for changes; reload with SIGHUP", "err", err)
		} else {
			events, watchErrs = w.Events, w.Errors
		}
	}

	reload := func(why string) {
		p, err := srv.Reload(path, check)
		if err != nil {
			logger.Error("config reload refused; keeping the configuration in force", "why", why, "path", path, "err", err)
			return
		}
		logger.Info("config reloaded", "why", why, "path", path, "auth", p.AuthEnabled())
	}
	var debounce <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			reload("SIGHUP")
		case ev := <-events:
			if changesConfig(ev, path) && ev.Op&(fsnotify.Write|fsnotify.Create|fsnotify.Rename) != 0 {
				debounce = time.After(reloadDebounce)
			}
		case err := <-watchErrs:
			logger.Warn("config watch error", "err", err)
		case <-debounce:
			debounce = nil
			reload("file changed")
		}
	}
}

// changesConfig reports whether ev, an event in the directory of the config
// file at path, may have changed that file: an event on the file itself, or
// on the "..data" link beside it, which Kubernetes swaps when it updates a
// mounted ConfigMap or Secret (the file is a link through "..data" and sees
// no event of its own).
func changesConfig(ev fsnotify.Event, path string) bool {
	name, dir := filepath.Clean(ev.Name), filepath.Dir(filepath.Clean(path))
	return name == filepath.Clean(path) || name == filepath.Join(dir, "..data")
}
