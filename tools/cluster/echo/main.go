// Command echo is the local cluster's test backend and client, one static
// binary in one image.
//
//	echo serve [-addr :8080] [-drain 5s]
//	echo get -url http://10.215.0.10/ [-n 20 | -duration 30s [-stop-file F]] [-interval 0] [-timeout 2s]
//	echo stop -file F
//
// serve answers GET / with one JSON line naming the pod, its IP, the node and
// the zone it runs in ($POD_NAME, $POD_IP, $NODE_NAME, $ZONE, from the
// downward API; ZONE may be empty) and GET /readyz with 200 until it is told to stop: on SIGTERM it
// fails /readyz, keeps serving for -drain (the time the endpoint's removal
// takes to reach every node) and then shuts down gracefully.
//
// get makes -n requests (or requests for -duration, ending early once
// -stop-file exists), each on a new connection, and prints one JSON object: the count of answers per node and
// per pod IP, the number of failed
// requests and, among them, connections reset, with the first few errors.
// It exits 1 when a request failed.
//
// stop creates the file a running get was given as -stop-file: a test ends
// its load when the change it measures is over, however long that took.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/topolb/topolb/tools/cluster/echo/api"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: echo serve|get|stop [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "get":
		err = get(os.Args[2:])
	case "stop":
		err = stop(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: want serve, get or stop", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "echo:", err)
		os.Exit(1)
	}
}

func serve(args []string) error {
	fl := flag.NewFlagSet("serve", flag.ExitOnError)
	addr := fl.String("addr", ":8080", "listen address")
	drain := fl.Duration("drain", 5*time.Second, "after SIGTERM: keep serving this long, failing /readyz")
	fl.Parse(args)

	answer, err := json.Marshal(api.Answer{Pod: os.Getenv("POD_NAME"), IP: os.Getenv("POD_IP"), Node: os.Getenv("NODE_NAME"), Zone: os.Getenv("ZONE")})
	if err != nil {
		return err
	}
	answer = append(answer, '\n')
	var stopping atomic.Bool
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write(answer)
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if stopping.Load() {
			http.Error(w, "stopping", http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ok\n")
	})
	srv := &http.Server{Addr: *addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	select {
	case err := <-errc:
		return err
	case <-sigs:
	}
	stopping.Store(true)
	time.Sleep(*drain)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return srv.Shutdown(ctx)
}

func get(args []string) error {
	fl := flag.NewFlagSet("get", flag.ExitOnError)
	url := fl.String("url", "", "URL to request")
	n := fl.Int("n", 20, "requests, each on a new connection")
	duration := fl.Duration("duration", 0, "instead of -n: make requests for this long")
	interval := fl.Duration("interval", 0, "pause between requests")
	timeout := fl.Duration("timeout", 2*time.Second, "timeout per request")
	stopFile := fl.String("stop-file", "", "with -duration: end early once this file exists (echo stop)")
	fl.Parse(args)
	if *url == "" {
		return errors.New("get: -url is required")
	}
	if *stopFile != "" && *duration == 0 {
		return errors.New("get: -stop-file needs -duration, its upper bound")
	}
	stopped := func() bool {
		if *stopFile == "" {
			return false
		}
		_, err := os.Stat(*stopFile)
		return err == nil
	}
	client := &http.Client{
		Timeout:   *timeout,
		Transport: &http.Transport{DisableKeepAlives: true},
	}
	res := api.Result{ByNode: map[string]int{}, ByIP: map[string]int{}}
	end := time.Now().Add(*duration)
	for i := 0; ; i++ {
		if (*duration == 0 && i >= *n) || (*duration > 0 && time.Now().After(end)) || stopped() {
			break
		}
		if i > 0 && *interval > 0 {
			time.Sleep(*interval)
		}
		res.Requests++
		a, err := getOne(client, *url)
		if err != nil {
			res.Failed++
			if errors.Is(err, syscall.ECONNRESET) {
				res.Resets++
			}
			if len(res.Errors) < 5 {
				res.Errors = append(res.Errors, err.Error())
			}
			continue
		}
		res.ByNode[a.Node]++
		res.ByIP[a.IP]++
	}
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		return err
	}
	if res.Failed > 0 {
		return fmt.Errorf("%d of %d requests failed", res.Failed, res.Requests)
	}
	return nil
}

func stop(args []string) error {
	fl := flag.NewFlagSet("stop", flag.ExitOnError)
	file := fl.String("file", "", "the -stop-file of a running get")
	fl.Parse(args)
	if *file == "" {
		return errors.New("stop: -file is required")
	}
	f, err := os.Create(*file)
	if err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	return f.Close()
}

func getOne(client *http.Client, url string) (api.Answer, error) {
	var a api.Answer
	resp, err := client.Get(url)
	if err != nil {
		return a, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return a, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
		return a, fmt.Errorf("GET %s: decode: %w", url, err)
	}
	return a, nil
}
