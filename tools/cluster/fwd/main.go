// Command fwd forwards TCP from a listener in its own network namespace to
// an address in another one, so the local cluster's API server, which runs
// in the cluster's fabric namespace, is reachable from the machine's
// 127.0.0.1 without an address or a link in the machine's namespace.
//
//	fwd -listen 127.0.0.1:16443 -netns /run/netns/tlbc-fabric -to 10.213.0.1:6443
package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

type dialReq struct {
	reply chan dialRes
}

type dialRes struct {
	conn net.Conn
	err  error
}

func main() {
	listen := flag.String("listen", "127.0.0.1:16443", "address to listen on, in this namespace")
	netns := flag.String("netns", "", "network namespace to dial from (a /run/netns path)")
	to := flag.String("to", "", "address to dial in -netns")
	flag.Parse()
	if *netns == "" || *to == "" {
		fmt.Fprintln(os.Stderr, "fwd: -netns and -to are required")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fwd:", err)
		os.Exit(1)
	}
	dials := make(chan dialReq)
	ready := make(chan error, 1)
	go dialer(*netns, *to, dials, ready)
	if err := <-ready; err != nil {
		fmt.Fprintln(os.Stderr, "fwd:", err)
		os.Exit(1)
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "fwd: accept:", err)
			os.Exit(1)
		}
		go func() {
			reply := make(chan dialRes, 1)
			dials <- dialReq{reply}
			r := <-reply
			if r.err != nil {
				fmt.Fprintln(os.Stderr, "fwd: dial:", r.err)
				c.Close()
				return
			}
			pipe(c, r.conn)
		}()
	}
}

// dialer owns one OS thread moved into netns: a socket belongs to the
// namespace of the thread that creates it, and stays there.
func dialer(netns, to string, reqs <-chan dialReq, ready chan<- error) {
	runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
	fd, err := unix.Open(netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err == nil {
		err = unix.Setns(fd, unix.CLONE_NEWNET)
		unix.Close(fd)
	}
	if err != nil {
		ready <- fmt.Errorf("enter %s: %w", netns, err)
		return
	}
	ready <- nil
	d := net.Dialer{Timeout: 5 * time.Second}
	for r := range reqs {
		c, err := d.Dial("tcp", to)
		r.reply <- dialRes{c, err}
	}
}

func pipe(a, b net.Conn) {
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go cp(a, b)
	go cp(b, a)
	<-done
	<-done
	a.Close()
	b.Close()
}
