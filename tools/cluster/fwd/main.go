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
	"time"

	"github.com/topolb/topolb/internal/netns"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:16443", "address to listen on, in this namespace")
	ns := flag.String("netns", "", "network namespace to dial from (a /run/netns path)")
	to := flag.String("to", "", "address to dial in -netns")
	flag.Parse()
	if *ns == "" || *to == "" {
		fmt.Fprintln(os.Stderr, "fwd: -netns and -to are required")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fwd:", err)
		os.Exit(1)
	}
	d := net.Dialer{Timeout: 5 * time.Second}
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "fwd: accept:", err)
			os.Exit(1)
		}
		go func() {
			// The socket belongs to the namespace it was created in.
			var up net.Conn
			err := netns.RunIn(*ns, func() (err error) {
				up, err = d.Dial("tcp", *to)
				return err
			})
			if err != nil {
				fmt.Fprintln(os.Stderr, "fwd: dial:", err)
				c.Close()
				return
			}
			pipe(c, up)
		}()
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
