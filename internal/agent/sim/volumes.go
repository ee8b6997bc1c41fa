package sim

import (
	"bytes"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// Volumes simulates the volume calls of the agent contract (PUT, GET,
// DELETE /v1/volumes/{id}, POST .../resize, volumes in a VM create, the
// detach of a deleted VM's volumes) in front of an agent's handler, for
// the control plane's tests on the sim driver. A volume is a record in
// <state dir>/volumes/<id>/volume.json (no disk content), so a restarted
// agent keeps its volumes and their attachments. Everything else goes to
// the agent's handler unchanged.
type Volumes struct {
	dir   string
	token string
	// imageSizeMiB tells whether the agent has an image and its disk's
	// size (0 for images without a disk, such as "sim").
	imageSizeMiB func(name string) (int64, bool)

	mu   sync.Mutex
	vols map[string]*simVolume
}

type simVolume struct {
	Spec agentapi.VolumeSpec `json:"spec"`
	// SizeMiB grows with resizes; Spec keeps the create's size.
	SizeMiB int64 `json:"size_mib"`
	// Attached maps each VM the volume is attached to to read_only.
	Attached map[string]bool `json:"attached"`
}

// NewVolumes returns the simulation keeping its records under stateDir,
// accepting token and the images of d.
func NewVolumes(stateDir, token string, d *Driver) (*Volumes, error) {
	v := &Volumes{dir: filepath.Join(stateDir, "volumes"), token: token, vols: map[string]*simVolume{},
		imageSizeMiB: func(name string) (int64, bool) {
			img, err := d.Image(name)
			return img.BaseDiskMiB, err == nil
		}}
	if err := os.MkdirAll(v.dir, 0o750); err != nil {
		return nil, fmt.Errorf("sim volumes: %w", err)
	}
	entries, err := os.ReadDir(v.dir)
	if err != nil {
		return nil, fmt.Errorf("sim volumes: %w", err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(v.dir, e.Name(), "volume.json"))
		if err != nil {
			continue // a create that died before its record: no volume
		}
		var sv simVolume
		if err := json.Unmarshal(b, &sv); err != nil {
			return nil, fmt.Errorf("sim volumes: volume %s: %w", e.Name(), err)
		}
		if sv.Attached == nil {
			sv.Attached = map[string]bool{}
		}
		v.vols[e.Name()] = &sv
	}
	return v, nil
}

// IDs lists the volumes the simulation holds, sorted.
func (v *Volumes) IDs() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	ids := make([]string, 0, len(v.vols))
	for id := range v.vols {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Wrap serves the volume calls and hands every other request to next.
func (v *Volumes) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := r.URL.Path
		vmCall := strings.HasPrefix(p, "/v1/vms/") && strings.Count(p, "/") == 3 &&
			(r.Method == http.MethodPut || r.Method == http.MethodDelete)
		if !strings.HasPrefix(p, "/v1/volumes") && !vmCall {
			next.ServeHTTP(w, r)
			return
		}
		got := []byte(r.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, []byte("Bearer "+v.token)) != 1 {
			writeVolumeError(w, http.StatusUnauthorized, "unauthorized", "missing or wrong bearer token: send Authorization: Bearer <agent token>")
			return
		}
		if vmCall {
			v.vmCall(w, r, next, strings.TrimPrefix(p, "/v1/vms/"))
			return
		}
		rest := strings.Trim(strings.TrimPrefix(p, "/v1/volumes"), "/")
		id, action, _ := strings.Cut(rest, "/")
		switch {
		case id == "" && r.Method == http.MethodGet:
			v.list(w)
		case id != "" && action == "" && r.Method == http.MethodPut:
			v.put(w, r, id)
		case id != "" && action == "" && r.Method == http.MethodGet:
			v.get(w, id)
		case id != "" && action == "" && r.Method == http.MethodDelete:
			v.delete(w, id)
		case id != "" && action == "resize" && r.Method == http.MethodPost:
			v.resize(w, r, id)
		default:
			writeVolumeError(w, http.StatusNotFound, "not_found", "no such call: "+r.Method+" "+p)
		}
	})
}

func (v *Volumes) list(w http.ResponseWriter) {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := agentapi.VolumeList{Items: []agentapi.Volume{}}
	for id, sv := range v.vols {
		out.Items = append(out.Items, sv.answer(id))
	}
	slices.SortFunc(out.Items, func(a, b agentapi.Volume) int { return strings.Compare(a.ID, b.ID) })
	writeVolumeJSON(w, http.StatusOK, out)
}

func (v *Volumes) put(w http.ResponseWriter, r *http.Request, id string) {
	if _, err := uuid.Parse(id); err != nil {
		writeVolumeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("volume id %q is not a UUID", id))
		return
	}
	var spec agentapi.VolumeSpec
	if !decodeVolumeBody(w, r, &spec) {
		return
	}
	if spec.SizeMiB <= 0 {
		writeVolumeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("size_mib must be positive, got %d", spec.SizeMiB))
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if sv, ok := v.vols[id]; ok {
		if !sameVolumeSpec(sv.Spec, spec) {
			writeVolumeError(w, http.StatusConflict, "conflict", fmt.Sprintf("volume %s exists with another spec", id))
			return
		}
		writeVolumeJSON(w, http.StatusOK, sv.answer(id))
		return
	}
	if src := spec.Source; src != nil {
		var srcMiB int64
		switch {
		case src.Image != "" && src.Volume != "":
			writeVolumeError(w, http.StatusBadRequest, "invalid", "source names an image and a volume: give one")
			return
		case src.Image != "":
			size, ok := v.imageSizeMiB(src.Image)
			if !ok {
				writeVolumeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("image %q does not exist on this agent", src.Image))
				return
			}
			srcMiB = size
		case src.Volume != "":
			from, ok := v.vols[src.Volume]
			if !ok {
				writeVolumeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("source volume %s does not exist on this agent", src.Volume))
				return
			}
			srcMiB = from.SizeMiB
		}
		if spec.SizeMiB < srcMiB {
			writeVolumeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("size_mib %d is below the source's %d MiB", spec.SizeMiB, srcMiB))
			return
		}
	}
	sv := &simVolume{Spec: spec, SizeMiB: spec.SizeMiB, Attached: map[string]bool{}}
	if err := v.save(id, sv); err != nil {
		writeVolumeError(w, http.StatusInternalServerError, "internal", err.Error())
		return
	}
	v.vols[id] = sv
	writeVolumeJSON(w, http.StatusCreated, sv.answer(id))
}

func sameVolumeSpec(a, b agentapi.VolumeSpec) bool {
	as, bs := agentapi.VolumeSource{}, agentapi.VolumeSource{}
	if a.Source != nil {
		as = *a.Source
	}
	if b.Source != nil {
		bs = *b.Source
	}
	return a.SizeMiB == b.SizeMiB && as == bs
}

func (v *Volumes) get(w http.ResponseWriter, id string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	sv, ok := v.vols[id]
	if !ok {
		writeVolumeError(w, http.StatusNotFound, "not_found", fmt.Sprintf("volume %s does not exist on this agent", id))
		return
	}
	writeVolumeJSON(w, http.StatusOK, sv.answer(id))
}

func (v *Volumes) delete(w http.ResponseWriter, id string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	sv, ok := v.vols[id]
	if !ok {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if vm := sv.answer(id).AttachedTo; vm != "" {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusConflict)
		_ = json.NewEncoder(w).Encode(agentapi.ErrorBody{Error: agentapi.ErrorDetail{Code: "volume_attached",
			Message: fmt.Sprintf("volume %s is attached to vm %s: detach it first", id, vm), Details: map[string]any{"vm_id": vm}}})
		return
	}
	if err := os.RemoveAll(filepath.Join(v.dir, id)); err != nil {
		writeVolumeError(w, http.StatusInternalServerError, "internal", err.Error())
		return
	}
	delete(v.vols, id)
	w.WriteHeader(http.StatusNoContent)
}

func (v *Volumes) resize(w http.ResponseWriter, r *http.Request, id string) {
	var in agentapi.VolumeResize
	if !decodeVolumeBody(w, r, &in) {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	sv, ok := v.vols[id]
	switch {
	case !ok:
		writeVolumeError(w, http.StatusNotFound, "not_found", fmt.Sprintf("volume %s does not exist on this agent", id))
		return
	case in.SizeMiB < sv.SizeMiB:
		writeVolumeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("volume %s has %d MiB: it grows, never shrinks (asked %d)", id, sv.SizeMiB, in.SizeMiB))
		return
	}
	grown := *sv
	grown.SizeMiB = in.SizeMiB
	if err := v.save(id, &grown); err != nil {
		writeVolumeError(w, http.StatusInternalServerError, "internal", err.Error())
		return
	}
	*sv = grown
	writeVolumeJSON(w, http.StatusOK, sv.answer(id))
}

// vmCall handles PUT and DELETE /v1/vms/{id}: a create's volumes are
// checked and attached (and left out of what the agent's handler reads),
// a delete detaches the VM's volumes once the agent deleted it.
func (v *Volumes) vmCall(w http.ResponseWriter, r *http.Request, next http.Handler, vmID string) {
	if r.Method == http.MethodDelete {
		rec := &statusRecorder{ResponseWriter: w}
		next.ServeHTTP(rec, r)
		if rec.status < 300 {
			v.mu.Lock()
			defer v.mu.Unlock()
			v.detachAll(vmID)
		}
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 4<<20))
	if err != nil {
		writeVolumeError(w, http.StatusBadRequest, "invalid", "read body: "+err.Error())
		return
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(body, &fields) != nil || fields["volumes"] == nil {
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
		return
	}
	var atts []agentapi.VolumeAttachment
	if err := json.Unmarshal(fields["volumes"], &atts); err != nil {
		writeVolumeError(w, http.StatusBadRequest, "invalid", "volumes: "+err.Error())
		return
	}
	delete(fields, "volumes")
	rest, _ := json.Marshal(fields)
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, a := range atts {
		sv, ok := v.vols[a.ID]
		if !ok {
			writeVolumeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("volume %s does not exist on this agent", a.ID))
			return
		}
		for other, ro := range sv.Attached {
			if other != vmID && (!ro || !a.ReadOnly) {
				writeVolumeError(w, http.StatusConflict, "conflict", fmt.Sprintf("volume %s is attached to vm %s", a.ID, other))
				return
			}
		}
	}
	r.Body = io.NopCloser(bytes.NewReader(rest))
	r.ContentLength = int64(len(rest))
	rec := &statusRecorder{ResponseWriter: w}
	next.ServeHTTP(rec, r)
	if rec.status >= 300 {
		return
	}
	for _, a := range atts {
		sv := v.vols[a.ID]
		sv.Attached[vmID] = a.ReadOnly
		_ = v.save(a.ID, sv) // the VM runs with it attached either way
	}
}

// detachAll detaches vmID from every volume (v.mu held).
func (v *Volumes) detachAll(vmID string) {
	for id, sv := range v.vols {
		if _, ok := sv.Attached[vmID]; ok {
			delete(sv.Attached, vmID)
			_ = v.save(id, sv)
		}
	}
}

func (v *Volumes) save(id string, sv *simVolume) error {
	dir := filepath.Join(v.dir, id)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	b, err := json.Marshal(sv)
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, "volume.json.tmp")
	if err := os.WriteFile(tmp, b, 0o640); err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	return os.Rename(tmp, filepath.Join(dir, "volume.json"))
}

func (sv *simVolume) answer(id string) agentapi.Volume {
	out := agentapi.Volume{ID: id, SizeMiB: sv.SizeMiB, Serial: agentapi.VolumeSerial(id), State: agentapi.VolumeReady}
	vms := make([]string, 0, len(sv.Attached))
	for vm := range sv.Attached {
		vms = append(vms, vm)
	}
	slices.Sort(vms)
	for _, vm := range vms {
		if !sv.Attached[vm] {
			out.AttachedTo, out.ReadOnly = vm, false // a read-write attachment is the one to name
			return out
		}
	}
	if len(vms) > 0 {
		out.AttachedTo, out.ReadOnly = vms[0], true
	}
	return out
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

func decodeVolumeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		writeVolumeError(w, http.StatusBadRequest, "invalid", "request body is not valid JSON for this call: "+err.Error())
		return false
	}
	return true
}

func writeVolumeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeVolumeError(w http.ResponseWriter, status int, code, msg string) {
	writeVolumeJSON(w, status, agentapi.ErrorBody{Error: agentapi.ErrorDetail{Code: code, Message: msg}})
}
