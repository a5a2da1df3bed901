// Command image writes a single-layer container image as an OCI archive (the
// tar that `ctr images import` and `docker load` read) from files built on
// the host, onto an empty base: no registry, no container engine.
//
//	image -o topolb.tar -name localhost/topolb:dev -dockerfile Dockerfile -context .
//	image -o echo.tar -name localhost/topolb-echo:dev -file bin/echo:/echo -entrypoint /echo
//
// With -dockerfile, the files, entrypoint and user are those of the
// Dockerfile's final stage: each `COPY --from=<stage>` source, which the
// build stage made under its WORKDIR from the build context, is taken from
// the same path under -context (so `make build`'s bin/ for the topolb
// image), and ENTRYPOINT and USER are copied. The published image's base
// (distroless/static: CA certificates, tzdata) is not included.
package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
)

// file is one regular file of the image: src on the host, dst in the image.
type file struct{ src, dst string }

// spec is what the image holds.
type spec struct {
	files      []file
	entrypoint []string
	user       string
}

type fileList []file

func (l *fileList) String() string { return fmt.Sprint(*l) }
func (l *fileList) Set(v string) error {
	src, dst, ok := strings.Cut(v, ":")
	if !ok || src == "" || !path.IsAbs(dst) {
		return fmt.Errorf("want SRC:/ABS/DST, got %q", v)
	}
	*l = append(*l, file{src, dst})
	return nil
}

func main() {
	var (
		out, name, dockerfile, context, entrypoint, user string
		files                                            fileList
	)
	flag.StringVar(&out, "o", "", "OCI archive to write")
	flag.StringVar(&name, "name", "", "image name, e.g. localhost/topolb:dev")
	flag.StringVar(&dockerfile, "dockerfile", "", "take files, ENTRYPOINT and USER from this Dockerfile's final stage")
	flag.StringVar(&context, "context", ".", "with -dockerfile: the build context the build stage copied")
	flag.Var(&files, "file", "SRC:/DST, a file to add (repeatable)")
	flag.StringVar(&entrypoint, "entrypoint", "", "the entrypoint, space-separated")
	flag.StringVar(&user, "user", "", "the image's user")
	flag.Parse()
	if out == "" || name == "" {
		fmt.Fprintln(os.Stderr, "image: -o and -name are required")
		os.Exit(2)
	}
	s := spec{files: files, entrypoint: strings.Fields(entrypoint), user: user}
	if dockerfile != "" {
		var err error
		if s, err = fromDockerfile(dockerfile, context); err != nil {
			fmt.Fprintln(os.Stderr, "image:", err)
			os.Exit(1)
		}
	}
	if err := write(out, name, s); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

// fromDockerfile reads the final stage of a Dockerfile: its COPY --from
// sources mapped back to the build context through the build stage's
// WORKDIR, ENTRYPOINT (exec form) and USER.
func fromDockerfile(dockerfile, context string) (spec, error) {
	f, err := os.Open(dockerfile)
	if err != nil {
		return spec{}, err
	}
	defer f.Close()
	var s spec
	workdir := map[string]string{} // stage name -> WORKDIR
	stage := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") {
			continue
		}
		switch strings.ToUpper(fields[0]) {
		case "FROM":
			// A new stage: only the last one's instructions count.
			s, stage = spec{}, ""
			if len(fields) == 4 && strings.EqualFold(fields[2], "AS") {
				stage = fields[3]
			}
		case "WORKDIR":
			workdir[stage] = fields[1]
		case "COPY":
			from, args := "", fields[1:]
			for len(args) > 0 && strings.HasPrefix(args[0], "--") {
				if v, ok := strings.CutPrefix(args[0], "--from="); ok {
					from = v
				}
				args = args[1:]
			}
			if from == "" || len(args) < 2 {
				continue // from the context into a build stage
			}
			wd, ok := workdir[from]
			if !ok {
				return spec{}, fmt.Errorf("%s: COPY --from=%s: stage has no WORKDIR", dockerfile, from)
			}
			dst := args[len(args)-1]
			for _, src := range args[:len(args)-1] {
				rel, err := filepath.Rel(wd, src)
				if err != nil || strings.HasPrefix(rel, "..") {
					return spec{}, fmt.Errorf("%s: COPY source %s is outside the build stage's WORKDIR %s", dockerfile, src, wd)
				}
				d := dst
				if strings.HasSuffix(dst, "/") {
					d = path.Join(dst, path.Base(src))
				}
				s.files = append(s.files, file{filepath.Join(context, rel), d})
			}
		case "ENTRYPOINT":
			arg := strings.TrimSpace(strings.TrimPrefix(sc.Text(), fields[0]))
			if err := json.Unmarshal([]byte(arg), &s.entrypoint); err != nil {
				return spec{}, fmt.Errorf("%s: ENTRYPOINT %s: want the exec form: %w", dockerfile, arg, err)
			}
		case "USER":
			s.user = fields[1]
		}
	}
	if err := sc.Err(); err != nil {
		return spec{}, err
	}
	if len(s.files) == 0 || len(s.entrypoint) == 0 {
		return spec{}, fmt.Errorf("%s: final stage copies no files or has no ENTRYPOINT", dockerfile)
	}
	return s, nil
}

// blob is one content-addressed blob of the archive.
type blob struct {
	mediaType string
	data      []byte
}

func (b blob) digest() string {
	sum := sha256.Sum256(b.data)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func (b blob) descriptor(annotations map[string]string) map[string]any {
	d := map[string]any{"mediaType": b.mediaType, "digest": b.digest(), "size": len(b.data)}
	if annotations != nil {
		d["annotations"] = annotations
	}
	return d
}

func write(out, name string, s spec) error {
	layer, err := layerTar(s.files)
	if err != nil {
		return err
	}
	l := blob{"application/vnd.oci.image.layer.v1.tar", layer}
	config := map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config": map[string]any{
			"Entrypoint": s.entrypoint,
			"User":       s.user,
			"Env":        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{l.digest()}},
	}
	c, err := jsonBlob("application/vnd.oci.image.config.v1+json", config)
	if err != nil {
		return err
	}
	m, err := jsonBlob("application/vnd.oci.image.manifest.v1+json", map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        c.descriptor(nil),
		"layers":        []any{l.descriptor(nil)},
	})
	if err != nil {
		return err
	}
	tag := name[strings.LastIndex(name, ":")+1:]
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests": []any{m.descriptor(map[string]string{
			"io.containerd.image.name":          name,
			"org.opencontainers.image.ref.name": tag,
		})},
	})
	if err != nil {
		return err
	}

	tmp := out + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	entries := []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", index},
	}
	for _, b := range []blob{l, c, m} {
		entries = append(entries, struct {
			name string
			data []byte
		}{"blobs/sha256/" + strings.TrimPrefix(b.digest(), "sha256:"), b.data})
	}
	for _, e := range entries {
		if err = tw.WriteHeader(&tar.Header{Name: e.name, Mode: 0o644, Size: int64(len(e.data)), Typeflag: tar.TypeReg}); err == nil {
			_, err = tw.Write(e.data)
		}
		if err != nil {
			break
		}
	}
	err = errors.Join(err, tw.Close(), f.Close())
	if err != nil {
		return errors.Join(err, os.Remove(tmp))
	}
	return os.Rename(tmp, out)
}

func jsonBlob(mediaType string, v any) (blob, error) {
	data, err := json.Marshal(v)
	return blob{mediaType, data}, err
}

// layerTar is the image's one layer: the files with their parent
// directories, in a stable order with zero times, so the same binaries give
// the same image digest.
func layerTar(files []file) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	sort.Slice(files, func(i, j int) bool { return files[i].dst < files[j].dst })
	for _, f := range files {
		var parents []string
		for d := path.Dir(f.dst); d != "/"; d = path.Dir(d) {
			parents = append([]string{d}, parents...)
		}
		for _, d := range parents {
			if dirs[d] {
				continue
			}
			dirs[d] = true
			if err := tw.WriteHeader(&tar.Header{Name: strings.TrimPrefix(d, "/") + "/", Mode: 0o755, Typeflag: tar.TypeDir}); err != nil {
				return nil, err
			}
		}
		src, err := os.Open(f.src)
		if err != nil {
			return nil, err
		}
		st, err := src.Stat()
		if err == nil {
			err = tw.WriteHeader(&tar.Header{Name: strings.TrimPrefix(f.dst, "/"), Mode: int64(st.Mode().Perm()), Size: st.Size(), Typeflag: tar.TypeReg})
		}
		if err == nil {
			_, err = io.Copy(tw, src)
		}
		if err = errors.Join(err, src.Close()); err != nil {
			return nil, fmt.Errorf("add %s: %w", f.src, err)
		}
	}
	return buf.Bytes(), tw.Close()
}
