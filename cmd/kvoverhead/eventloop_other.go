//go:build !linux

package main

import "errors"

func serveEventLoop(listen, upstream string) error {
	return errors.New("the event-loop proxy runs on Linux only (epoll)")
}
