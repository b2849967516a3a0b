package mockengine

import (
	"sync"

	"github.com/kvproxy/kvproxy/tokenize"
)

// responseStoreCap bounds the responses an engine keeps for
// previous_response_id and GET /v1/responses/{id}; the oldest go first.
// (vLLM keeps them all, in memory, and warns that it leaks.)
const responseStoreCap = 10000

// storedResponse is what a later request needs of a stored response.
type storedResponse struct {
	id          string
	messages    []tokenize.Message // the messages its prompt was rendered from
	outputTexts []string           // the text of each output_text part
	object      []byte             // the response object as answered
}

// responseStore keeps stored responses by id, dropping the oldest past cap.
type responseStore struct {
	mu    sync.Mutex
	cap   int
	byID  map[string]*storedResponse
	order []string // ids oldest first; may hold deleted ones
}

func newResponseStore(capacity int) *responseStore {
	return &responseStore{cap: capacity, byID: make(map[string]*storedResponse)}
}

func (s *responseStore) put(r *storedResponse) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byID[r.id] = r
	s.order = append(s.order, r.id)
	for len(s.byID) > s.cap {
		delete(s.byID, s.order[0])
		s.order = s.order[1:]
	}
	if len(s.order) > 2*s.cap+64 { // drop the deleted ids' places
		live := make([]string, 0, len(s.byID))
		for _, id := range s.order {
			if s.byID[id] != nil {
				live = append(live, id)
			}
		}
		s.order = live
	}
}

func (s *responseStore) get(id string) *storedResponse {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byID[id]
}

// remove deletes a response and reports whether it was there.
func (s *responseStore) remove(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.byID[id]
	delete(s.byID, id)
	return ok
}
